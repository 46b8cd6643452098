"""Shard statistics (after encode+pack): Arrow shards -> per (split, source) figures, read zero-copy with numpy.

Per pair: rows, real tokens, documents, EOS and padding shares and a log2 document-length histogram; numpy
over the memory-mapped ``input_ids`` instead of token-level SQL (``unnest`` over Arrow is ~90x slower).

Document lengths come from the rows' lineage (``doc_ids``/``doc_starts``/``num_tokens``): a document's
tokens are the spans it covers in consecutive rows of its (split, source), so a document that spans rows or
shards is measured whole. Lengths count the document's own tokens, its ``<|endoftext|>`` excluded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import ConfigError, ShardFormatError
from core.rundir import RunPaths
from core.shards.check import open_checked_shard
from core.shards.store import ShardInfo, read_shard_index

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
"""Names of the special tokens (as in ``tokenization.config.SPECIAL_TOKENS``; ``pipeline`` does not import it)."""
CONTRACT_EOS_ID, CONTRACT_PAD_ID = 0, 1
"""The ids the shard contract documents; used when the run has no ``tokenizer/tokenizer.json``."""
NUM_HISTOGRAM_BUCKETS = 33
"""Bucket 0 holds empty documents, bucket b >= 1 lengths in [2**(b-1), 2**b - 1]; the last is open-ended."""


def histogram_bucket_labels() -> list[str]:
    """Labels of the fixed log2 buckets: ``"0"``, ``"1"``, ``"2-3"``, ``"4-7"``, …, ``"2147483648+"``."""
    labels = ["0", "1"]
    for bucket in range(2, NUM_HISTOGRAM_BUCKETS):
        low = 1 << (bucket - 1)
        labels.append(f"{low}+" if bucket == NUM_HISTOGRAM_BUCKETS - 1 else f"{low}-{2 * low - 1}")
    return labels


def doc_length_histogram(doc_tokens: np.ndarray) -> dict[str, int]:
    """Counts of document lengths (tokens) per fixed log2 bucket, every bucket listed (zeros included)."""
    lengths = np.asarray(doc_tokens, dtype=np.int64)
    # frexp's exponent of n >= 1 is n's bit length: 1 -> 1, 2..3 -> 2, 4..7 -> 3; of 0 it is 0.
    buckets = np.minimum(np.frexp(lengths.astype(np.float64))[1], NUM_HISTOGRAM_BUCKETS - 1)
    counts = np.bincount(buckets, minlength=NUM_HISTOGRAM_BUCKETS)
    return dict(zip(histogram_bucket_labels(), (int(count) for count in counts), strict=True))


def format_histogram(histogram: dict[str, int]) -> str:
    """A compact one-line form of the non-empty buckets, e.g. ``"64-127:3 128-255:12 256-511:5"``."""
    return " ".join(f"{label}:{count}" for label, count in histogram.items() if count)


@dataclass
class _PairTotals:
    """Running totals of one (split, source) while its shards are read in index (= packing) order."""

    num_shards: int = 0
    size_bytes: int = 0
    num_rows: int = 0
    num_slots: int = 0
    num_tokens: int = 0
    num_eos: int = 0
    num_documents: int = 0
    entry_doc_ids: list[np.ndarray] = field(default_factory=list)
    entry_tokens: list[np.ndarray] = field(default_factory=list)


def shard_stats(run_dir: str | Path, histogram: str = "text") -> list[dict[str, Any]]:
    """One flat dict per (split, source), in index order; raises ShardFormatError without a shard index, when
    an index row names a path outside the shard layout or the run dir (:func:`core.shards.store.read_shard_index`), or
    when a shard's bytes differ from the index (:func:`core.shards.check.open_checked_shard`).

    Keys: ``split, source, num_shards, size_bytes, num_rows, num_tokens`` (real tokens, padding excluded),
    ``num_documents`` (documents that start in the pair), ``eos_share`` (EOS tokens / real tokens),
    ``pad_share`` (padding / (rows * seq_len)), ``doc_tokens_median``, ``doc_tokens_max`` (document
    lengths in tokens, EOS excluded) and ``doc_tokens_hist``: the log2 histogram of those lengths, as
    :func:`format_histogram` text (``histogram="text"``) or as the full bucket dict (``histogram="dict"``).
    """
    if histogram not in ("text", "dict"):
        raise ConfigError(f"histogram={histogram!r}: use 'text' (one compact string) or 'dict' (bucket -> count).")
    run_dir = Path(run_dir)
    eos_id = special_token_ids(run_dir)[0]
    pairs: dict[tuple[str, str], _PairTotals] = {}
    for info in read_shard_index(run_dir):
        _add_shard(pairs.setdefault((info.split, info.source), _PairTotals()), run_dir, info, eos_id)
    return [_pair_row(split, source, totals, histogram) for (split, source), totals in pairs.items()]


def special_token_ids(run_dir: Path) -> tuple[int, int]:
    """(eos_id, pad_id) from the run's ``tokenizer/special_tokens.json`` (a model's own tokenizer), else from
    ``tokenizer/tokenizer.json`` (its added tokens), else the contract's 0, 1."""
    paths = RunPaths(run_dir)
    if paths.special_tokens.is_file():
        record = json.loads(paths.special_tokens.read_text(encoding="utf-8"))
        return int(record["eos_id"]), int(record["pad_id"])
    path = paths.tokenizer
    if not path.is_file():
        return CONTRACT_EOS_ID, CONTRACT_PAD_ID
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardFormatError(f"{path}: not a tokenizer.json ({err}); restore the run's tokenizer, or re-run "
                               "`tokenmill prepare` on a fresh run dir.") from None
    tokens = tokenizer.get("added_tokens", []) if isinstance(tokenizer, dict) else []
    added = {token.get("content"): token.get("id") for token in tokens if isinstance(token, dict)}
    return added.get(EOS_TOKEN, CONTRACT_EOS_ID), added.get(PAD_TOKEN, CONTRACT_PAD_ID)


def _add_shard(totals: _PairTotals, run_dir: Path, info: ShardInfo, eos_id: int) -> None:
    """Add one shard's rows, tokens, EOS count and (row, document) entries to its pair's totals."""
    path = run_dir / info.path
    shard = open_checked_shard(run_dir, info)
    try:
        num_tokens = []
        for batch in _batches(path):
            doc_ids, entry_tokens = _entry_spans(batch)
            totals.entry_doc_ids.append(doc_ids)
            totals.entry_tokens.append(entry_tokens)
            continued = int(np.count_nonzero(batch.column("first_doc_offset").to_numpy()))
            totals.num_documents += len(doc_ids) - continued
            num_tokens.append(batch.column("num_tokens").to_numpy())
        real = np.concatenate(num_tokens) if num_tokens else np.zeros(0, dtype=np.int32)
        tokens = shard.tokens
        totals.num_eos += int(np.count_nonzero(tokens == eos_id)) - _eos_in_padding(tokens, real, eos_id)
        totals.num_slots += int(tokens.size)
    finally:
        shard.close()
    totals.num_shards += 1
    totals.size_bytes += path.stat().st_size
    totals.num_rows += len(real)
    totals.num_tokens += int(real.sum(dtype=np.int64))


def _batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The shard's record batches, read zero-copy from a memory map."""
    with pa.memory_map(str(path)) as source:
        reader = ipc.open_file(source)
        for number in range(reader.num_record_batches):
            yield reader.get_batch(number)


def _eos_in_padding(tokens: np.ndarray, num_tokens: np.ndarray, eos_id: int) -> int:
    """EOS ids in the padded tails (only a pack call's last row has one); 0 unless pad == EOS."""
    padded_rows = np.flatnonzero(num_tokens < tokens.shape[1])
    return sum(int(np.count_nonzero(tokens[row, num_tokens[row]:] == eos_id)) for row in padded_rows)


def _entry_spans(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """Per (row, document) entry: the doc_id and how many of the row's real tokens it covers (EOS included).

    An entry runs from its ``doc_starts`` value to the next entry's start in the same row, or to the
    row's ``num_tokens`` for the row's last entry.
    """
    doc_ids = batch.column("doc_ids").flatten().to_numpy()
    starts = batch.column("doc_starts").flatten().to_numpy().astype(np.int64)
    per_row = batch.column("doc_ids").value_lengths().to_numpy(zero_copy_only=False).astype(np.int64)
    num_tokens = batch.column("num_tokens").to_numpy().astype(np.int64)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    row_last_entry = np.cumsum(per_row)[per_row > 0] - 1
    ends[row_last_entry] = num_tokens[per_row > 0]
    return doc_ids, ends - starts


def _document_tokens(totals: _PairTotals) -> np.ndarray:
    """Each document's length in tokens (EOS excluded): its consecutive entries summed, in stream order."""
    if not totals.entry_doc_ids:
        return np.zeros(0, dtype=np.int64)
    doc_ids = np.concatenate(totals.entry_doc_ids)
    entry_tokens = np.concatenate(totals.entry_tokens)
    if not doc_ids.size:
        return np.zeros(0, dtype=np.int64)
    first_entries = np.concatenate([[0], np.flatnonzero(doc_ids[1:] != doc_ids[:-1]) + 1])
    return np.add.reduceat(entry_tokens, first_entries) - 1


def _pair_row(split: str, source: str, totals: _PairTotals, histogram: str) -> dict[str, Any]:
    doc_tokens = _document_tokens(totals)
    counts = doc_length_histogram(doc_tokens)
    return {
        "split": split, "source": source, "num_shards": totals.num_shards, "size_bytes": totals.size_bytes,
        "num_rows": totals.num_rows, "num_tokens": totals.num_tokens, "num_documents": totals.num_documents,
        "eos_share": round(totals.num_eos / totals.num_tokens, 6) if totals.num_tokens else 0.0,
        "pad_share": round(1 - totals.num_tokens / totals.num_slots, 6) if totals.num_slots else 0.0,
        "doc_tokens_median": float(np.median(doc_tokens)) if doc_tokens.size else 0.0,
        "doc_tokens_max": int(doc_tokens.max()) if doc_tokens.size else 0,
        "doc_tokens_hist": counts if histogram == "dict" else format_histogram(counts),
    }
