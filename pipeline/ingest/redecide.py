"""Filter stage, again: re-decide an ingested part under new thresholds from ``attributes/part-NNNNN.parquet`` and
the stored texts (documents' ``text``, rejects' ``text``), without opening a source file.

Only the thresholds changed (:mod:`pipeline.filters.thresholds`), so each stored value is still what the filter would
measure. A document rejected at ingest was measured only up to the row that rejected it: when new thresholds let it
past that row, it is measured again from its stored text (:func:`pipeline.filters.screen.measure_text`). The part's
documents (and MinHash signatures) are rewritten only when its kept documents changed; otherwise its marker keeps its
documents' fingerprint, which the dedupe stage and the stages after it key on, so they stay skipped.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from core.rundir import RunPaths, fingerprint
from core.schemas import ATTRIBUTES_SCHEMA, REJECTS_SCHEMA, documents_schema
from pipeline.config import NearDedupeConfig
from pipeline.filters.screen import QUALITY_FILTERS, UNMEASURED, measure_text, redecide
from pipeline.ingest.part_files import (
    ParquetSink,
    SignatureCollector,
    attribute_row,
    document_row,
    reject_row,
)
from pipeline.ingest.readers import Reject
from pipeline.ingest.records import Record, structured_record
from pipeline.manifest import FilterConfig

FILTER_REASONS = frozenset(row.reason for row in QUALITY_FILTERS)


def redecide_part(part_id: int, filters: FilterConfig, val_fraction: float, paths: RunPaths,
                  fingerprints: tuple[str, str], near: NearDedupeConfig | None,
                  marker: dict[str, Any], records: str = "text") -> tuple[dict[str, Any], str]:
    """Rewrite the part's rejects and attributes (and its documents when the kept set changed) under ``filters``;
    returns the ingest summary, with ``redecided: True`` and ``num_changed`` (documents whose verdict changed), and
    the fingerprint of its kept documents (the one its ``marker`` recorded while they stay the same).
    ``records``: the part's source's (``chat``, ``preference``: a document brought back gets its conversation or pair
    again, from the reject's ``raw``)."""
    docs_path, rejects_path = paths.document_part(part_id), paths.rejects_part(part_id)
    attributes_path = paths.attributes_part(part_id)
    docs = {row["uri"]: row for row in pq.read_table(docs_path).to_pylist()}
    rejects = pq.read_table(rejects_path, schema=REJECTS_SCHEMA).to_pylist()
    filtered = {row["uri"]: row for row in rejects if row["reason"] in FILTER_REASONS}
    broken = [row for row in rejects if row["reason"] not in FILTER_REASONS]
    kept_rows, rejected_rows, attribute_rows = [], [], []
    num_changed = 0
    for values in pq.read_table(attributes_path).to_pylist():
        was_kept = values["reason"] is None
        row, values = _redecided(values, docs.get(values["uri"]), filtered.get(values["uri"]), filters, val_fraction,
                                 records)
        (rejected_rows if "reason" in row else kept_rows).append(row)
        attribute_rows.append(attribute_row(row, values))
        num_changed += was_kept == ("reason" in row)
    kept_changed = {row["uri"] for row in kept_rows} != docs.keys()
    _write_rows(rejects_path, REJECTS_SCHEMA, broken + rejected_rows, paths)
    _write_rows(attributes_path, ATTRIBUTES_SCHEMA, attribute_rows, paths)
    part_fingerprint = marker["documents"]
    if kept_changed:
        part_fingerprint = fingerprint(*fingerprints)
        with SignatureCollector(paths, part_id, part_fingerprint, near) as signatures:
            _write_rows(docs_path, documents_schema(records != "text"), kept_rows, paths, signatures.add)
            signatures.write()
    reasons = Counter(row["reason"] for row in broken + rejected_rows)
    summary = {**marker["summary"], "num_documents": len(kept_rows), "num_rejects": sum(reasons.values()),
               "rejects_by_reason": dict(sorted(reasons.items())), "redecided": True, "num_changed": num_changed}
    return summary, part_fingerprint


def _redecided(values: dict[str, Any], kept: dict[str, Any] | None, rejected: dict[str, Any] | None,
               filters: FilterConfig, val_fraction: float, records: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(documents or rejects row, measured values)`` of one document under ``filters``."""
    verdict = redecide(values, filters)
    if kept is not None and verdict is None:
        return kept, values
    if kept is not None and verdict != UNMEASURED:
        text = kept["text"]
        # the source record is not read again: its conversation or pair (record) or normalised text stands for it
        raw = (kept.get("record") or text).encode("utf-8")
        row = reject_row(Reject(kept["uri"], verdict[0], verdict[1], raw, kept["source_id"]), kept["source"])
        return {**row, "text": text}, values
    if rejected is None or rejected["text"] is None:
        raise AssertionError(f"{values['uri']}: no stored text to re-decide from")  # ingest stores every one
    if verdict not in (None, UNMEASURED):
        assert isinstance(verdict, tuple)
        return {**rejected, "reason": verdict[0], "detail": verdict[1]}, values
    text, failed, measured = measure_text(rejected["text"], filters)
    if failed is not None:
        return {**rejected, "reason": failed[0], "detail": failed[1]}, measured
    record = _record_json(records, rejected["raw"]) if records != "text" else None
    return document_row(rejected["source"], rejected["uri"], rejected["source_id"], text, val_fraction,
                        record), measured


def _record_json(records: str, raw: bytes | None) -> str | None:
    """The normalised conversation or pair of a chat or preference reject's ``raw`` (its line, or its record JSON)."""
    parsed = structured_record(records, json.loads(raw or b"null"), "", raw, None) if raw else None
    return parsed.record if isinstance(parsed, Record) else None


def _write_rows(path: Path, schema: pa.Schema, rows: list[dict[str, Any]], paths: RunPaths,
                on_flush: Callable[[pa.Table], None] | None = None) -> None:
    """``rows`` to a Parquet part as ingest writes it (documents: each split in row groups of its own), atomically."""
    with paths.atomic_write(path) as tmp:
        writer = (ParquetSink(tmp, schema, on_flush=on_flush, group_column="split") if on_flush is not None
                  else ParquetSink(tmp, schema))
        for row in rows:
            writer.append({name: row.get(name) for name in schema.names}, len(row.get("text") or ""))
        writer.close()
