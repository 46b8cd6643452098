"""Near-dedupe index for the dedupe stage: docs parts -> cached MinHash signatures and LSH band keys -> scored pairs.

Out of core: each part's signatures (``dedupe/minhash/part-NNNNN.parquet``) and band keys
(``dedupe/bands/part-NNNNN.parquet``) are written once; DuckDB groups the band keys on disk and only the
documents that share a bucket are read back (signatures, and text for exact checks), so memory grows
with the candidates, not with the corpus. Pairs whose MinHash estimate is within
``near.exact_verify_margin`` of the threshold are decided by the exact Jaccard of their shingle sets.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.layout import BANDS_DIR as BANDS_DIR  # re-exported (pipeline.dedupe, tests)
from core.layout import MINHASH_DIR as MINHASH_DIR
from core.rundir import RunPaths
from pipeline.config import DedupeConfig, NearDedupeConfig
from pipeline.dedupe import minhash

SIGNATURE_BATCH_ROWS = 512
SIGNATURE_BLOCK_BYTES = 8 << 20
"""A signature cache is written in row groups of at most this many bytes of signatures (16,384 documents at
128 permutations): the most of them a writer holds, so ingest's memory does not grow with a part's size."""
EXACT_VERIFY_BUDGET_BYTES = 128 << 20
"""Most memory held by shingle sets for exact verification (4 bytes per distinct shingle)."""


@dataclass(frozen=True)
class DocsPart:
    """A finished documents part and the fingerprint its marker recorded (the signature cache key)."""

    part_id: int
    path: Path
    fingerprint: str


class NearIndex:
    """The parts' cached MinHash signatures and LSH band keys, addressed by catalog index.

    ``doc_offsets[i]`` is the catalog index of part ``i``'s first document (parts in catalog order).
    """

    def __init__(self, parts: list[DocsPart], doc_offsets: list[int], paths: RunPaths, config: DedupeConfig) -> None:
        self.parts, self.doc_offsets, self.paths, self.config = parts, doc_offsets, paths, config
        self.bands, self.rows = minhash.lsh_params(config.near.threshold, config.near.num_perm)

    def candidate_pairs(self, excluded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Catalog index pairs sharing an LSH bucket, grouped by DuckDB over the band-key files."""
        band_files = [part_band_keys(part, self.paths, self.config, self.bands, self.rows) for part in self.parts]
        with tempfile.TemporaryDirectory(prefix=".tmp-duckdb-", dir=self.paths.dedupe) as spill:
            return minhash.grouped_candidate_pairs(band_files, self.doc_offsets, excluded, Path(spill))

    def signatures(self, docs: np.ndarray) -> np.ndarray:
        """``(len(docs), num_perm)`` signatures of the sorted catalog indices ``docs``, read part by part."""
        pieces = [part_signature_rows(part, self.paths, self.config, rows) for part, _, rows in self.rows_by_part(docs)]
        return np.concatenate(pieces) if pieces else np.empty((0, self.config.near.num_perm), dtype=np.uint32)

    def rows_by_part(self, docs: np.ndarray) -> list[tuple[DocsPart, int, np.ndarray]]:
        """The sorted catalog indices ``docs`` as (part, its first catalog index, rows within it) per part."""
        bounds = np.searchsorted(docs, [*self.doc_offsets[1:], np.iinfo(np.int64).max])
        found, start = [], 0
        for part, offset, stop in zip(self.parts, self.doc_offsets, bounds, strict=True):
            if stop > start:
                found.append((part, offset, docs[start:stop] - offset))
            start = stop
        return found


class PairScorer:
    """Jaccard of document pairs among ``nodes``: the MinHash estimate, or the exact value near the threshold.

    Exact values need the documents' shingle sets (~0.6x their text in memory); at most
    ``EXACT_VERIFY_BUDGET_BYTES`` of them are held, taken in catalog order, and pairs beyond that budget
    keep their estimate, so memory stays bounded however many pairs are close to the threshold.
    """

    def __init__(self, index: NearIndex, nodes: np.ndarray) -> None:
        self.index, self.nodes = index, nodes
        self.signatures = index.signatures(nodes)
        self._shingles: dict[int, np.ndarray] = {}
        self._shingle_bytes = 0

    def similarity(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """Per pair of catalog indices (all in ``nodes``): estimated Jaccard, exact when within the margin."""
        near = self.index.config.near
        similarity = minhash.estimated_jaccard(self.signatures, np.searchsorted(self.nodes, left),
                                               np.searchsorted(self.nodes, right))
        unsure = np.flatnonzero(np.abs(similarity - near.threshold) < near.exact_verify_margin)
        if len(unsure):
            from pipeline.dedupe import kernels  # numba: imported where it is first needed (see minhash.word_hashes)

            self._load_shingles(minhash.sorted_unique(np.concatenate([left[unsure], right[unsure]])))
            for pair, a, b in zip(unsure.tolist(), left[unsure].tolist(), right[unsure].tolist(), strict=True):
                if a in self._shingles and b in self._shingles:
                    similarity[pair] = kernels.sorted_set_jaccard(self._shingles[a], self._shingles[b])
        return similarity

    def _load_shingles(self, docs: np.ndarray) -> None:
        """Shingle sets of ``docs`` not loaded yet, one read per part, until the budget is spent."""
        missing = np.array([doc for doc in docs.tolist() if doc not in self._shingles], dtype=np.int64)
        ngram = self.index.config.near.ngram
        for part, offset, rows in self.index.rows_by_part(missing):
            if self._shingle_bytes >= EXACT_VERIFY_BUDGET_BYTES:
                return
            texts = read_rows(part.path, rows, "text")
            for start in range(0, len(rows), SIGNATURE_BATCH_ROWS):
                words, word_offsets = minhash.word_hashes(texts.slice(start, SIGNATURE_BATCH_ROWS))
                shingles, offsets = minhash.shingle_hashes(words, word_offsets, ngram)
                for position, row in enumerate(rows[start : start + SIGNATURE_BATCH_ROWS].tolist()):
                    # The low 32 bits of the mixed 64-bit hashes: half the memory, and a spurious match
                    # between two documents' ~10^3-10^4 shingles has odds of ~10^-2 at worst.
                    own = shingles[offsets[position] : offsets[position + 1]]
                    unique = minhash.sorted_unique(own.astype(np.uint32))
                    if self._shingle_bytes + unique.nbytes > EXACT_VERIFY_BUDGET_BYTES:
                        return
                    self._shingles[offset + row] = unique
                    self._shingle_bytes += unique.nbytes


def read_rows(path: Path, rows: np.ndarray, column: str) -> pa.Array:
    """``column`` at the sorted ``rows`` of a Parquet file, decompressing only the row groups holding them."""
    parquet = pq.ParquetFile(path)
    bounds = np.cumsum([0] + [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)])
    pieces = []
    for group in np.unique(np.searchsorted(bounds, rows, side="right") - 1).tolist():
        wanted = rows[(rows >= bounds[group]) & (rows < bounds[group + 1])] - bounds[group]
        pieces.append(parquet.read_row_group(group, columns=[column]).column(column).take(wanted).combine_chunks())
    return pa.concat_arrays(pieces) if pieces else pa.array([], pa.large_string())


def signature_cache_metadata(docs_fingerprint: str, near: NearDedupeConfig) -> dict[str, str]:
    """What a part's signature cache must match: the part (its ingest fingerprint) and the MinHash settings."""
    return {"docs_fingerprint": docs_fingerprint, "implementation": minhash.IMPLEMENTATION,
            "words": minhash.WORDS_VERSION,
            "num_perm": str(near.num_perm), "ngram": str(near.ngram), "seed": str(minhash.MINHASH_SEED)}


def near_cache_files(paths: RunPaths, part_name: str) -> tuple[Path, Path]:
    """A docs part's signature and band-key caches (``part_name``: ``part-NNNNN.parquet``)."""
    return paths.near_caches(part_name)


def _cache_is_valid(cache: Path, metadata: dict[str, str]) -> bool:
    if not cache.is_file():
        return False
    stored = {key.decode(): value.decode() for key, value in (pq.read_schema(cache).metadata or {}).items()}
    return all(stored.get(key) == value for key, value in metadata.items())




def signature_block_rows(num_perm: int) -> int:
    """Documents per signature cache row group: SIGNATURE_BLOCK_BYTES of uint32 signatures."""
    return max(1, SIGNATURE_BLOCK_BYTES // (4 * num_perm))


def _signature_table(signatures: np.ndarray) -> pa.Table:
    """``(documents, num_perm)`` signatures as one fixed-size-list column, sharing their memory."""
    flat = pa.array(signatures.reshape(-1), type=pa.uint32())
    return pa.table({"signature": pa.FixedSizeListArray.from_arrays(flat, signatures.shape[1])})


class SignatureBlocks:
    """Signatures of consecutive documents in, row groups of ``signature_block_rows`` documents out.

    Holds at most one block: a block's worth of input is written as it is, the rest is copied into the
    block buffer until it is full.
    """

    def __init__(self, writer: pq.ParquetWriter, num_perm: int) -> None:
        self._writer = writer
        self._block = np.empty((signature_block_rows(num_perm), num_perm), dtype=np.uint32)
        self._filled = 0

    def add_texts(self, texts: pa.Array | pa.ChunkedArray, near: NearDedupeConfig) -> None:
        """Add the texts' signatures, computed SIGNATURE_BATCH_ROWS texts at a time."""
        for start in range(0, len(texts), SIGNATURE_BATCH_ROWS):
            self.add(minhash.signatures(texts.slice(start, SIGNATURE_BATCH_ROWS), near.num_perm, near.ngram))

    def add(self, signatures: np.ndarray) -> None:
        block_rows = len(self._block)
        start = 0
        while start < len(signatures):
            if not self._filled and len(signatures) - start >= block_rows:
                self._writer.write_table(_signature_table(signatures[start : start + block_rows]))
                start += block_rows
                continue
            take = min(block_rows - self._filled, len(signatures) - start)
            self._block[self._filled : self._filled + take] = signatures[start : start + take]
            self._filled += take
            start += take
            if self._filled == block_rows:
                self.flush()

    def flush(self) -> None:
        """Write the buffered signatures as a row group (none: nothing)."""
        if self._filled:
            self._writer.write_table(_signature_table(self._block[: self._filled]))
            self._filled = 0


@contextlib.contextmanager
def signature_cache_writer(paths: RunPaths, cache: Path, metadata: dict[str, str],
                           num_perm: int) -> Iterator[SignatureBlocks]:
    """Write a signature cache block by block, atomically: renamed over ``cache`` on success, removed on error.

    One fixed-size-list column tagged with ``metadata``, uncompressed and without dictionary pages:
    signatures are uniformly random bits (zstd spent ~0.4 s per 100 MB of them for nothing).
    """
    schema = _signature_table(np.empty((0, num_perm), dtype=np.uint32)).schema.with_metadata(metadata)
    with (paths.atomic_write(cache) as tmp,
          pq.ParquetWriter(tmp, schema, compression="none", use_dictionary=False) as writer):
        blocks = SignatureBlocks(writer, num_perm)
        yield blocks
        blocks.flush()


def _signature_block(table: pa.Table, num_perm: int) -> np.ndarray:
    """One row group of a signature cache as a ``(documents, num_perm)`` array."""
    column = table.column("signature").combine_chunks()
    return column.flatten().to_numpy().reshape(-1, num_perm)


def signature_cache(part: DocsPart, paths: RunPaths, near: NearDedupeConfig) -> pq.ParquetFile:
    """The part's signature cache: the one ingest wrote (or an earlier dedupe run) when still valid, else made
    now from the part's text, block by block like ingest makes it."""
    cache, _ = near_cache_files(paths, part.path.name)
    metadata = signature_cache_metadata(part.fingerprint, near)
    if not _cache_is_valid(cache, metadata):
        with (pq.ParquetFile(part.path) as documents,
              signature_cache_writer(paths, cache, metadata, near.num_perm) as blocks):
            for batch in documents.iter_batches(batch_size=SIGNATURE_BATCH_ROWS, columns=["text"]):
                blocks.add_texts(batch.column("text"), near)
    return pq.ParquetFile(cache)


def part_signature_rows(part: DocsPart, paths: RunPaths, config: DedupeConfig, rows: np.ndarray) -> np.ndarray:
    """Signatures of the part's sorted ``rows``, reading only the cache's row groups that hold them."""
    near = config.near
    signatures = np.empty((len(rows), near.num_perm), dtype=np.uint32)
    with signature_cache(part, paths, near) as cache:
        group_start = 0
        for group in range(cache.num_row_groups):
            group_stop = group_start + cache.metadata.row_group(group).num_rows
            first, last = np.searchsorted(rows, [group_start, group_stop])
            if last > first:
                block = _signature_block(cache.read_row_group(group, columns=["signature"]), near.num_perm)
                signatures[first:last] = block[rows[first:last] - group_start]
            group_start = group_stop
    return signatures


def part_band_keys(part: DocsPart, paths: RunPaths, config: DedupeConfig, bands: int, rows: int) -> Path:
    """``dedupe/bands/part-NNNNN.parquet``: one ``(row, band, key)`` per document and LSH band (made once).

    Written one signature row group at a time, so memory holds one block, not the part's signatures.
    """
    _, cache = near_cache_files(paths, part.path.name)
    metadata = {**signature_cache_metadata(part.fingerprint, config.near), "bands": str(bands), "rows": str(rows)}
    if _cache_is_valid(cache, metadata):
        return cache
    schema = pa.schema([("row", pa.int32()), ("band", pa.int16()), ("key", pa.uint64())], metadata=metadata)
    with (signature_cache(part, paths, config.near) as signatures, paths.atomic_write(cache) as tmp,
          pq.ParquetWriter(tmp, schema, compression="zstd") as writer):
        start = 0
        for group in range(signatures.num_row_groups):
            block = _signature_block(signatures.read_row_group(group, columns=["signature"]), config.near.num_perm)
            keys = minhash.band_keys(block, bands, rows)
            writer.write_table(pa.table({"row": np.tile(np.arange(start, start + len(block), dtype=np.int32), bands),
                                         "band": np.repeat(np.arange(bands, dtype=np.int16), len(block)),
                                         "key": keys.T.reshape(-1)}, schema=schema))
            start += len(block)
    return cache
