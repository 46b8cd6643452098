"""Shard sampling (after encode+pack): Arrow shards -> random packed rows, decoded, with their documents' uris.

For eyeballing what the model is fed: each sampled row comes back as a flat dict with where it lies
(shard path, row number, split, source), its lineage (doc_ids, doc_starts, each document's ``uri``) and
its text decoded with the special tokens left visible (``<|endoftext|>`` between documents).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.ipc as ipc

from core.documents import document_part_files
from core.errors import ConfigError
from core.rundir import RunPaths
from core.shards.check import open_checked_shard
from core.shards.store import ShardInfo, read_shard_index
from tokenization.train_tokenizer import PAD_TOKEN, load_tokenizer


def sample_rows(run_dir: str | Path, n: int, seed: int = 0, split: str | None = None, source: str | None = None,
                decode: bool = True) -> list[dict[str, Any]]:
    """``n`` packed rows drawn without replacement (all rows when fewer), the same ones for the same seed.

    Rows come back in shard-path then row order, one flat dict each: ``shard_path, row`` (0-based in the
    shard), ``split, source, num_tokens`` (real tokens), ``num_pad_tokens``, ``first_doc_offset``,
    ``doc_ids``, ``doc_starts``, ``uris`` (aligned with doc_ids; None for a doc_id missing from ``docs/``)
    and ``text`` (the real tokens decoded with special tokens shown, then ``<|pad|>×N`` for padding) when
    ``decode`` else ``input_ids`` (the real tokens). Raises ConfigError for ``n < 1`` or a split/source
    without shards, ShardFormatError without a shard index or when a sampled shard's bytes differ from it.
    """
    if n < 1:
        raise ConfigError(f"n={n}: ask for at least one row.")
    paths = RunPaths(run_dir)
    infos = _matching_shards(read_shard_index(paths.root), split, source)
    chosen = _choose_rows(infos, n, seed)
    rows = [row for info, numbers in chosen for row in _read_rows(paths.root, info, numbers)]
    uris = _uris_of(paths, {doc_id for row in rows for doc_id in row["doc_ids"]})
    for row in rows:
        row["uris"] = [uris.get(doc_id) for doc_id in row["doc_ids"]]
    if decode:
        _decode_rows(paths.tokenizer, rows)
    return rows


def _matching_shards(infos: list[ShardInfo], split: str | None, source: str | None) -> list[ShardInfo]:
    matching = [info for info in infos if split in (None, info.split) and source in (None, info.source)]
    if not matching:
        pairs = ", ".join(sorted({f"{info.split}/{info.source}" for info in infos})) or "none"
        raise ConfigError(f"no shards with split={split!r}, source={source!r}; this run has (split/source): {pairs}.")
    return matching


def _choose_rows(infos: list[ShardInfo], n: int, seed: int) -> list[tuple[ShardInfo, np.ndarray]]:
    """The sampled row numbers per shard (shards in index order, rows ascending)."""
    ends = np.cumsum([info.num_rows for info in infos])
    total = int(ends[-1]) if len(ends) else 0
    picked = np.sort(np.random.default_rng(seed).choice(total, size=min(n, total), replace=False))
    shard_of = np.searchsorted(ends, picked, side="right")
    firsts = ends - np.array([info.num_rows for info in infos])
    return [(infos[number], picked[shard_of == number] - firsts[number]) for number in np.unique(shard_of)]


def _read_rows(run_dir: Path, info: ShardInfo, numbers: np.ndarray) -> list[dict[str, Any]]:
    """The rows ``numbers`` of one shard: tokens from the zero-copy reader, lineage from the Arrow columns."""
    path = run_dir / info.path
    shard = open_checked_shard(run_dir, info)
    try:
        with pa.memory_map(str(path)) as source:
            lineage = ipc.open_file(source).read_all().select(["doc_ids", "doc_starts", "first_doc_offset",
                                                               "num_tokens"]).take(pa.array(numbers))
        rows = []
        for number, row in zip(numbers.tolist(), lineage.to_pylist(), strict=True):
            real = row["num_tokens"]
            rows.append({"shard_path": info.path, "row": number, "split": info.split, "source": info.source,
                         "num_tokens": real, "num_pad_tokens": shard.seq_len - real,
                         "first_doc_offset": row["first_doc_offset"], "doc_ids": row["doc_ids"],
                         "doc_starts": row["doc_starts"], "uris": None,
                         "input_ids": shard.tokens[number, :real].tolist()})
    finally:
        shard.close()
    return rows


def _uris_of(paths: RunPaths, doc_ids: set[int]) -> dict[int, str]:
    """{doc_id: uri} for the given documents, read from every finished ``docs/`` part (duplicates included)."""
    parts = document_part_files(paths)
    if not doc_ids or not parts:
        return {}
    dataset = ds.dataset([str(part) for part in parts], format="parquet")
    found = dataset.to_table(columns=["doc_id", "uri"],
                             filter=pc.field("doc_id").isin(pa.array(sorted(doc_ids), type=pa.int64())))
    return dict(zip(found.column("doc_id").to_pylist(), found.column("uri").to_pylist(), strict=True))


def _decode_rows(tokenizer_path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace each row's ``input_ids`` by ``text``: special tokens kept visible, padding as ``<|pad|>×N``."""
    tokenizer = load_tokenizer(tokenizer_path)
    texts = tokenizer.decode_batch([row["input_ids"] for row in rows], skip_special_tokens=False)
    for row, text in zip(rows, texts, strict=True):
        del row["input_ids"]
        row["text"] = text + (f"{PAD_TOKEN}×{row['num_pad_tokens']}" if row["num_pad_tokens"] else "")
