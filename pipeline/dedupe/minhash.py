"""Near-dedupe building blocks: texts -> word n-gram shingles -> MinHash signatures -> LSH candidate pairs.

Words and shingles come from compiled one-pass loops over the batch's UTF-8 bytes
(:mod:`pipeline.dedupe.kernels`), banding is vectorised numpy, and the MinHash itself runs in rensa's Rust
``RMinHash`` when installed (measured 2x a numba loop and ~70x numpy: ``benchmarks/minhash_impls.py``),
else in numpy.
Signatures are cached per part, so the implementation name is recorded with them and a cache made by the
other one is recomputed.
"""

from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

try:
    from rensa import RMinHash
except ImportError:  # pragma: no cover - rensa is a declared dependency; numpy keeps the stage working
    RMinHash = None

MINHASH_SEED = 0x70CE
"""Fixed seed: signatures must be identical across runs and machines (they are cached and compared)."""
WORDS_VERSION = "normalised-words-fnv1a-3"
"""How texts become words (:func:`word_hashes`); stored beside cached signatures with the implementation."""
NUMPY_IMPLEMENTATION = "numpy-multiply-shift-1"
IMPLEMENTATION = f"rensa-rminhash-{RMinHash.ALGORITHM_VERSION}" if RMinHash is not None else NUMPY_IMPLEMENTATION
"""Name of the MinHash implementation in use, stored beside cached signatures."""
CANDIDATE_WINDOW = 8
"""Within an LSH bucket each document is compared with the bucket's first and its next 8 members."""
_FALSE_POSITIVE_WEIGHT = 0.02
_VERIFY_CHUNK_PAIRS = 1 << 16
_NUMPY_CHUNK_SHINGLES = 1 << 14

# Odd 64-bit constants: position multipliers for n-gram hashing (MurmurHash3/SplitMix-style mixing).
_POSITION_MULTIPLIERS = np.array([(0x9E3779B97F4A7C15 * (2 * k + 1)) % 2**64 for k in range(32)], dtype=np.uint64)
_FMIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_FMIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT_33 = np.uint64(33)


def _fmix64(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser: spreads every input bit over the whole word."""
    values = values ^ (values >> _SHIFT_33)
    values = values * _FMIX_1
    values = values ^ (values >> _SHIFT_33)
    values = values * _FMIX_2
    return values ^ (values >> _SHIFT_33)


def word_hashes(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Normalised words as uint64 hashes, flat, with int64 per-document offsets: the words near dedupe compares.

    Case-folded (Unicode), separated by any whitespace, punctuation or symbol, every digit read as ``0``
    (as datatrove's ``simplify_text`` and text-dedup normalise before shingling), so copies that differ only
    in punctuation, quotes, case or spacing have the same shingles. ASCII texts take one compiled pass over
    their bytes; others are rewritten in Python first (:func:`pipeline.dedupe.kernels.word_hashes`).
    """
    from pipeline.dedupe import kernels  # numba (~0.5 s to import): not paid by a run that has nothing to hash

    return kernels.word_hashes(texts)


def whitespace_word_hashes(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The words of ``text.encode().lower().split()`` as uint64 hashes, with per-document offsets.

    Decontamination's words: its reject detail quotes the shared n-gram by whitespace-word position.
    """
    from pipeline.dedupe import kernels  # numba (~0.5 s): only when there is text to hash

    return kernels.whitespace_word_hashes(texts)


def shingle_hashes(hashes: np.ndarray, offsets: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every run of ``ngram`` consecutive words per document, with per-document offsets.

    A document shorter than ``ngram`` words is one shingle of all its words (a document without words
    gets one constant shingle), so every document has a non-empty shingle set.
    """
    from pipeline.dedupe import kernels  # numba (~0.5 s): only when there is text to hash

    return kernels.shingle_hashes(hashes, offsets, ngram, _POSITION_MULTIPLIERS)


def minhash_rensa(shingles: np.ndarray, offsets: np.ndarray, num_perm: int) -> np.ndarray:
    """``(num_docs, num_perm)`` uint32 signatures from rensa's Rust RMinHash."""
    matrix = RMinHash.digest_matrix_from_flat_token_hashes(
        shingles, offsets.astype(np.uint64), num_perm=num_perm, seed=MINHASH_SEED
    )
    return np.array(matrix.to_rows(), dtype=np.uint32).reshape(len(offsets) - 1, num_perm)


def minhash_numpy(shingles: np.ndarray, offsets: np.ndarray, num_perm: int) -> np.ndarray:
    """``(num_docs, num_perm)`` uint32 signatures: min over shingles of multiply-shift hashes, in chunks."""
    rng = np.random.default_rng(MINHASH_SEED)
    multipliers = rng.integers(0, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    increments = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
    num_docs = len(offsets) - 1
    signatures = np.full((num_docs, num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
    doc_of_shingle = np.repeat(np.arange(num_docs), np.diff(offsets))
    for start in range(0, len(shingles), _NUMPY_CHUNK_SHINGLES):
        chunk = shingles[start : start + _NUMPY_CHUNK_SHINGLES]
        permuted = ((chunk[:, None] * multipliers + increments) >> np.uint64(32)).astype(np.uint32)
        docs = doc_of_shingle[start : start + len(chunk)]
        segment_starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        segment_docs = docs[segment_starts]
        mins = np.minimum.reduceat(permuted, segment_starts, axis=0)
        signatures[segment_docs] = np.minimum(signatures[segment_docs], mins)
    return signatures


def signatures(texts: pa.Array | pa.ChunkedArray, num_perm: int, ngram: int, *,
               implementation: str = IMPLEMENTATION) -> np.ndarray:
    """MinHash signatures ``(len(texts), num_perm)`` uint32 of the texts' word ``ngram`` shingle sets."""
    hashes, offsets = word_hashes(texts)
    shingles, shingle_offsets = shingle_hashes(hashes, offsets, ngram)
    if implementation == NUMPY_IMPLEMENTATION or RMinHash is None:
        return minhash_numpy(shingles, shingle_offsets, num_perm)
    return minhash_rensa(shingles, shingle_offsets, num_perm)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` by sort + mask: numpy 2.4's hash-based ``np.unique`` measured 20-120x slower on
    high-cardinality integer arrays (2 M random uint64: 1.6 s against 0.013 s)."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


@functools.lru_cache(maxsize=64)
def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """``(bands, rows)`` with bands*rows <= num_perm minimising weighted false positive + negative area.

    The areas are the integrals of the banding S-curve ``1-(1-s^r)^b`` below the threshold (pairs that
    become candidates needlessly) and of its complement above it (duplicates never compared), as in
    datasketch's ``MinHashLSH``. Unlike datasketch's equal weights, false negatives weigh 0.98: every
    candidate is verified (exactly, near the threshold), so a false positive costs one signature
    comparison while a false negative loses a duplicate. At 0.8/128 this gives 17x7, which makes a pair
    at the threshold a candidate with p=0.98 (datasketch's 9x13: 0.40; 14x9: 0.87, which measured
    recall 0.967 on tests/pipeline/test_dedupe_quality.py against 1.000 for 17x7).
    """
    similarity = np.linspace(0.0, 1.0, 1001)
    below, above = similarity <= threshold, similarity >= threshold
    best, best_error = (1, num_perm), np.inf
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            candidate = 1.0 - (1.0 - similarity**rows) ** bands
            error = _FALSE_POSITIVE_WEIGHT * np.trapezoid(candidate[below], similarity[below]) + (
                1.0 - _FALSE_POSITIVE_WEIGHT
            ) * np.trapezoid(1.0 - candidate[above], similarity[above])
            if error < best_error - 1e-12:
                best, best_error = (bands, rows), error
    return best


def band_keys(signatures_matrix: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """``(num_docs, bands)`` uint64: one hash per band of ``rows`` signature values."""
    keys = np.zeros((signatures_matrix.shape[0], bands), dtype=np.uint64)
    for band in range(bands):
        accumulated = np.full(signatures_matrix.shape[0], band, dtype=np.uint64)
        for column in range(band * rows, (band + 1) * rows):
            accumulated = _fmix64(accumulated ^ signatures_matrix[:, column].astype(np.uint64))
        keys[:, band] = accumulated
    return keys


def candidate_pairs(keys: np.ndarray, window: int = CANDIDATE_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Unique ``(left, right)`` document index pairs, left < right, sharing at least one band key.

    In each bucket every member is paired with the bucket's earliest member (the likely survivor) and
    with its next ``window`` members, so buckets of up to window+1 documents get every pair while a
    huge bucket (boilerplate) stays linear instead of quadratic. In memory: ``keys`` is
    ``(num_docs, bands)``; :func:`grouped_candidate_pairs` gives the same pairs out of core.
    """
    num_docs = keys.shape[0]
    lefts, rights = [], []
    for band in range(keys.shape[1]):
        order = np.argsort(keys[:, band], kind="stable")  # stable: bucket members stay in document order
        ordered = keys[order, band]
        left, right = pairs_in_buckets(order, np.r_[True, ordered[1:] != ordered[:-1]], window)
        lefts.append(left)
        rights.append(right)
    return unique_pairs(lefts, rights, num_docs)


def pairs_in_buckets(docs: np.ndarray, bucket_start: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs within buckets: ``docs`` sorted by (bucket, doc), ``bucket_start`` True at each bucket's first row.

    Each member is paired with its bucket's first member and with the next ``window`` members.
    """
    num_rows = len(docs)
    row = np.arange(num_rows)
    first_of_bucket = docs[np.maximum.accumulate(np.where(bucket_start, row, 0))] if num_rows else docs
    bucket = np.cumsum(bucket_start)
    lefts, rights = [first_of_bucket[~bucket_start]], [docs[~bucket_start]]
    for distance in range(1, min(window, num_rows - 1) + 1):
        same = bucket[distance:] == bucket[:-distance]
        lefts.append(docs[:-distance][same])
        rights.append(docs[distance:][same])
    return np.concatenate(lefts), np.concatenate(rights)


def unique_pairs(lefts: list[np.ndarray], rights: list[np.ndarray], num_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs, each as (smaller, larger) index, sorted by (left, right)."""
    left = np.concatenate(lefts) if lefts else np.empty(0, dtype=np.int64)
    right = np.concatenate(rights) if rights else np.empty(0, dtype=np.int64)
    codes = sorted_unique(np.minimum(left, right).astype(np.int64) * num_docs + np.maximum(left, right))
    return codes // max(num_docs, 1), codes % max(num_docs, 1)


DUCKDB_MEMORY_LIMIT = "128MB"
"""DuckDB's working memory for band grouping; beyond it DuckDB spills to the run's dedupe folder."""
DUCKDB_ROWS_PER_THREAD = 1_000_000
"""Band rows per DuckDB thread: below ~1 M rows a second thread costs more CPU (starting, waiting) than it saves."""
# file_index: the position of the row's file in $files (an integer: a filename column would cost ~100
# bytes per band row).
_SHARED_BUCKET_MEMBERS_SQL = """
WITH keys AS (
    SELECT o.doc_offset + b."row" AS doc, b.band, b.key
    FROM read_parquet($files) AS b JOIN part_offsets AS o ON b.file_index = o.file_index
    WHERE NOT EXISTS (SELECT 1 FROM excluded AS e WHERE e.doc = o.doc_offset + b."row")),
shared AS (SELECT band, key FROM keys GROUP BY band, key HAVING count(*) > 1)
SELECT band, key, doc FROM keys SEMI JOIN shared USING (band, key) ORDER BY band, key, doc
"""


def grouped_candidate_pairs(band_files: list[Path], doc_offsets: list[int], excluded: np.ndarray,
                            temp_dir: Path, window: int = CANDIDATE_WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """:func:`candidate_pairs` out of core: DuckDB groups the band keys stored in Parquet files.

    Each file holds one part's ``row`` (int32, within the part), ``band`` (int16) and ``key`` (uint64);
    its documents are numbered from its ``doc_offsets`` entry. Documents in ``excluded`` take no part.
    Only rows of buckets with two or more members come back, so memory grows with the documents that
    share a bucket (the candidates), not with the corpus; DuckDB spills to ``temp_dir`` when it must.
    Returns unique ``(left, right)`` document numbers, left < right, sorted.
    """
    if not band_files:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    names = [str(path) for path in band_files]
    num_rows = sum(pq.read_metadata(path).num_rows for path in band_files)
    usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, min(usable_cpus, num_rows // DUCKDB_ROWS_PER_THREAD))
    config = {"temp_directory": str(temp_dir), "preserve_insertion_order": False, "memory_limit": DUCKDB_MEMORY_LIMIT,
              "threads": threads}
    with duckdb.connect(":memory:", config=config) as con:
        con.register("part_offsets", pa.table({"file_index": pa.array(range(len(names)), pa.int64()),
                                               "doc_offset": pa.array(doc_offsets, pa.int64())}))
        con.register("excluded", pa.table({"doc": pa.array(excluded, pa.int64())}))
        members = con.sql(_SHARED_BUCKET_MEMBERS_SQL, params={"files": names}).to_arrow_table()
    band = members.column("band").to_numpy()
    key = members.column("key").to_numpy()
    docs = members.column("doc").to_numpy()
    num_docs = int(docs.max(initial=0)) + 1
    codes = np.empty(0, dtype=np.int64)
    band_bounds = np.flatnonzero(np.r_[True, band[1:] != band[:-1], True]) if len(docs) else [0]
    for start, stop in itertools.pairwise(band_bounds):  # band by band: the raw pairs of one band at a time
        bucket_start = np.r_[True, key[start + 1 : stop] != key[start : stop - 1]]
        left, right = pairs_in_buckets(docs[start:stop], bucket_start, window)
        codes = sorted_unique(np.concatenate(
            [codes, np.minimum(left, right).astype(np.int64) * num_docs + np.maximum(left, right)]))
    return codes // num_docs, codes % num_docs


def estimated_jaccard(signatures_matrix: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Share of equal signature values per pair: the MinHash estimate of the shingle sets' Jaccard."""
    similarity = np.empty(len(left), dtype=np.float64)
    for start in range(0, len(left), _VERIFY_CHUNK_PAIRS):
        stop = start + _VERIFY_CHUNK_PAIRS
        equal = signatures_matrix[left[start:stop]] == signatures_matrix[right[start:stop]]
        similarity[start:stop] = equal.mean(axis=1)
    return similarity


def connected_components(num_nodes: int, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Component label per node: the smallest node index in its component (min-label propagation)."""
    labels = np.arange(num_nodes)
    while True:
        smaller = np.minimum(labels[left], labels[right])
        updated = labels.copy()
        np.minimum.at(updated, left, smaller)
        np.minimum.at(updated, right, smaller)
        while not np.array_equal(updated, jumped := updated[updated]):  # pointer jumping: follow to the root
            updated = jumped
        if np.array_equal(updated, labels):
            return labels
        labels = updated
