"""Read-only SQL over a run dir in a bucket (``s3://bucket/runs/NAME``): the run's artifacts as Arrow data, via fsspec.

:func:`pipeline.sql.query.open_views` calls this instead of reading local files, then confines DuckDB exactly as for a
local run (file access off, configuration locked): DuckDB never sees a URL or the filesystem, only the Arrow
datasets and tables registered here, so a statement cannot read another key of the bucket. Only keys under the
run's prefix are listed, and shards only at ``shards/split=<split>/source=<name>/part-NNNNN.arrow``; any other
``.arrow`` key under ``shards/`` is refused, naming it, as locally. Parquet is read by pyarrow through
``PyFileSystem(FSSpecHandler(fs))`` (ranged reads, only the columns and row groups a query needs); shards are read
whole into memory (an object cannot be memory-mapped).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow.fs import FSSpecHandler, PyFileSystem

from core.errors import QueryError
from core.files.atomic import TEMP_PREFIX
from core.layout import DOCS_PART_KEY, REJECTS_KEY, RELATIVE, SHARD_KEY, run_key
from core.schemas import ATTRIBUTES_SCHEMA, DOCUMENTS_SCHEMA, DUPLICATES_SCHEMA, REJECTS_SCHEMA, SHARD_INDEX_SCHEMA
from core.shards.check import damaged_shard_message
from core.shards.store import SHARD_LAYOUT
from pipeline.objects import ObjectPath, object_errors
from pipeline.sql import view_tables
from pipeline.sql.preference_pairs import PREFERENCE_PAIRS_SCHEMA, PREFERENCE_PAIRS_VIEW

if TYPE_CHECKING:
    import pyarrow.dataset as ds

SHARD_INDEX, SHARDS_PREFIX = run_key(RELATIVE.shard_index), f"{run_key(RELATIVE.shards)}/"
TRAIN_METRICS, EVAL_METRICS = run_key(RELATIVE.train_metrics), run_key(RELATIVE.eval_metrics)


def remote_run_tables(url: str, sql: str | None, unsupported: list[str]) -> dict[str, ds.Dataset | pa.Table]:
    """Every view's data of the run at ``url``, by the name :func:`pipeline.sql.query.open_views` registers it under.

    ``unsupported``: views not read from a bucket here (the trainer's derived views, eval_results,
    train_segments, preference_pairs: :func:`pipeline.sql.query.open_views` answers those on the run's mirror); a
    statement naming one is refused (QueryError) rather than answered from an empty view.
    """
    lowered = (sql or "").lower()
    named = [name for name in unsupported if sql is not None and name in lowered]
    if named:
        raise QueryError(f"{url}: the view(s) {', '.join(named)} are not read from object storage yet; query a "
                         "local copy of the run dir for them (the other views work on the bucket).")
    root = ObjectPath(url.rstrip("/"))
    fs, base = root.filesystem()
    with object_errors(url):
        keys = sorted(key[len(base) + 1:] for key in fs.find(base) if key.startswith(base + "/"))
    if not keys:
        raise QueryError(f"{url}: no run dir there (no objects under that prefix); give the prefix a tokenmill run "
                         "was uploaded to, e.g. s3://bucket/runs/NAME.")
    arrow_fs = PyFileSystem(FSSpecHandler(fs))
    present = set(keys)

    def parquet(rels: list[str], schema: pa.Schema) -> ds.Dataset | pa.Table:
        if not rels:
            return view_tables.empty_table(schema)
        # Imported here for start-up time: pyarrow.dataset imports pandas (0.2 s), which a local query never needs.
        import pyarrow.dataset as ds

        try:
            return ds.dataset([f"{base}/{rel}" for rel in rels], format="parquet", filesystem=arrow_fs)
        except (pa.ArrowException, OSError) as err:
            raise QueryError(f"{url}/{rels[0]}: not readable as Parquet ({err}); re-upload the run dir.") from None

    def text(rel: str) -> str:
        with object_errors(f"{url}/{rel}"):
            return fs.cat(f"{base}/{rel}").decode("utf-8", "replace") if rel in present else ""

    read_shards = sql is None or view_tables.SEQUENCES_VIEW in lowered
    return {
        "_docs": parquet(_finished_parts(keys, present), DOCUMENTS_SCHEMA),
        "duplicates": parquet([rel for rel in [run_key(RELATIVE.duplicates)] if rel in present], DUPLICATES_SCHEMA),
        "rejects": parquet([rel for rel in keys if REJECTS_KEY.fullmatch(rel)], REJECTS_SCHEMA),
        "attributes": parquet([rel for rel in (run_key(RELATIVE.attributes_of(part))
                                               for part in _finished_parts(keys, present)) if rel in present],
                              ATTRIBUTES_SCHEMA),
        "shards": parquet([rel for rel in [SHARD_INDEX] if rel in present], SHARD_INDEX_SCHEMA),
        "train_metrics": view_tables.metrics_table(view_tables.jsonl_objects(text(TRAIN_METRICS)),
                                                   f"{url}/{TRAIN_METRICS}", view_tables.TRAIN_METRICS_SCHEMA),
        "eval_metrics": view_tables.metrics_table(view_tables.jsonl_objects(text(EVAL_METRICS)),
                                                  f"{url}/{EVAL_METRICS}", view_tables.EVAL_METRICS_SCHEMA),
        "eval_results": view_tables.empty_table(view_tables.EVAL_RESULTS_SCHEMA),
        "train_segments": view_tables.empty_table(view_tables.TRAIN_SEGMENTS_SCHEMA),
        PREFERENCE_PAIRS_VIEW: view_tables.empty_table(PREFERENCE_PAIRS_SCHEMA),
        "sequences": _sequences(url, base, fs, _shard_keys(url, keys) if read_shards else []),
    }


def _finished_parts(keys: list[str], present: set[str]) -> list[str]:
    """``docs/part-NNNNN.parquet`` keys whose ingest marker was uploaded too (as :func:`document_part_files`)."""
    parts = []
    for rel in keys:
        match = DOCS_PART_KEY.fullmatch(rel)
        if match and run_key(RELATIVE.stage_marker("ingest", match.group(1))) in present:
            parts.append(rel)
    return parts


def _shard_keys(url: str, keys: list[str]) -> list[str]:
    """The shard keys; QueryError naming the first ``.arrow`` key under ``shards/`` outside the layout."""
    shards = []
    for rel in keys:
        name = rel.rsplit("/", 1)[-1]
        if not rel.startswith(SHARDS_PREFIX) or not rel.endswith(".arrow") or name.startswith(TEMP_PREFIX):
            continue
        if not SHARD_KEY.fullmatch(rel):
            raise QueryError(f"{url}: {rel!r} is not a shard tokenmill writes; shards live only at {SHARD_LAYOUT} "
                             "inside the run dir: remove or move it.")
        shards.append(rel)
    return shards


def _sequences(url: str, base: str, fs: Any, shard_keys: list[str]) -> pa.Table:
    """``sequences`` of the shards at ``shard_keys``, each checked as a local one is: its format, then its bytes'
    sha256 against ``shards/index.parquet`` (hashed as they are read: a shard is read whole anyway)."""
    recorded = _recorded_sha256(url, base, fs, shard_keys) if shard_keys else {}
    shards = {}
    for rel in shard_keys:
        read: list[bytes] = []

        def open_shard(rel: str = rel, read: list[bytes] = read) -> pa.BufferReader:
            with object_errors(f"{url}/{rel}"):
                read.append(fs.cat(f"{base}/{rel}"))
            return pa.BufferReader(read[0])
        shards[rel] = view_tables.checked_shard(open_shard, f"{url}/{rel}", url)
        if hashlib.sha256(read[0]).hexdigest() != recorded.get(rel):
            raise QueryError(damaged_shard_message(f"{url}/{rel}", url, "differs" if rel in recorded else "unlisted"))
    return view_tables.sequences_of(shards, url)


def _recorded_sha256(url: str, base: str, fs: Any, shard_keys: list[str]) -> dict[str, str]:
    """``{shard path: sha256}`` of the bucket's shard index; QueryError when it is missing or lists a shard that
    is not there."""
    index = f"{url}/{SHARD_INDEX}"
    with object_errors(index):
        data = fs.cat(f"{base}/{SHARD_INDEX}") if fs.exists(f"{base}/{SHARD_INDEX}") else None
    if data is None:
        raise QueryError(f"{index}: no shard index beside the shards, so their bytes cannot be checked; upload the "
                         "whole run dir (`sequences` reads only shards the index vouches for).")
    try:
        rows = pq.read_table(pa.BufferReader(data), columns=["path", "sha256"]).to_pylist()
    except (pa.ArrowException, OSError, KeyError) as err:
        raise QueryError(f"{index}: not a readable shard index ({err}); re-upload the run dir.") from None
    recorded = {row["path"]: row["sha256"] for row in rows if isinstance(row["path"], str)}
    missing = sorted(set(recorded) - set(shard_keys))
    if missing:
        raise QueryError(damaged_shard_message(f"{url}/{missing[0]}", url, "missing"))
    return recorded
