"""Benchmark behind the choice of MinHash implementation: rensa's RMinHash against numpy and numba.

All sides hash the same word 5-gram shingles of stdlib text (made once, by tokenmill's compiled kernel)
into 128-permutation signatures; only the MinHash step is timed, best of three, in CPU seconds:
- ``rensa``: ``pipeline.dedupe.minhash.minhash_rensa`` (Rust), what tokenmill uses;
- ``numpy``: ``pipeline.dedupe.minhash.minhash_numpy`` (multiply-shift, vectorised), tokenmill's fallback;
- ``numba``: a compiled multiply-shift loop, permutations innermost so it vectorises.

Run from the repo root: ``.venv/bin/python -m benchmarks.minhash_impls [--quick]``. The last line printed
is JSON: rensa against the faster of the other two.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numba
import numpy as np
import pyarrow as pa

from benchmarks.corpus import stdlib_texts
from benchmarks.result import print_result
from pipeline.dedupe import minhash

NUM_PERM = 128


@numba.njit(nogil=True, cache=True)
def _minhash_numba(shingles: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray,
                   out: np.ndarray) -> None:
    for doc in range(len(offsets) - 1):
        best = np.full(len(a), np.uint32(0xFFFFFFFF), dtype=np.uint32)
        for i in range(offsets[doc], offsets[doc + 1]):
            shingle = shingles[i]
            for perm in range(len(a)):
                value = np.uint32((a[perm] * shingle + b[perm]) >> np.uint64(32))
                if value < best[perm]:
                    best[perm] = value
        out[doc, :] = best


def minhash_numba(shingles: np.ndarray, offsets: np.ndarray, num_perm: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
    out = np.empty((len(offsets) - 1, num_perm), dtype=np.uint32)
    _minhash_numba(shingles.astype(np.uint64), offsets.astype(np.int64), a, b, out)
    return out


def best_cpu_seconds(function: Callable[[], object], repeats: int = 3) -> float:
    function()  # warm-up: numba compiles, caches fill
    times = []
    for _ in range(repeats):
        started = time.process_time()
        function()
        times.append(time.process_time() - started)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 MB of text instead of 20")
    parser.add_argument("--mb", type=float, default=None, help="MB of stdlib text (default 20, quick 5)")
    args = parser.parse_args(argv)
    num_bytes = int((args.mb or (5 if args.quick else 20)) * 1_000_000)
    texts = pa.array(stdlib_texts(num_bytes, min_words=20, max_words=5000))
    megabytes = sum(len(text.encode("utf-8")) for text in texts.to_pylist()) / 1e6
    hashes, offsets = minhash.word_hashes(texts)
    shingles, shingle_offsets = minhash.shingle_hashes(hashes, offsets, 5)
    print(f"{len(texts)} stdlib documents, {megabytes:.1f} MB, {len(shingles):,} shingles, {NUM_PERM} permutations")
    sides = {"rensa": lambda: minhash.minhash_rensa(shingles, shingle_offsets, NUM_PERM),
             "numpy": lambda: minhash.minhash_numpy(shingles, shingle_offsets, NUM_PERM),
             "numba": lambda: minhash_numba(shingles, shingle_offsets, NUM_PERM)}
    rates = {}
    for name, function in sides.items():
        seconds = best_cpu_seconds(function)
        rates[name] = megabytes / seconds
        print(f"{name:<6} {seconds:7.3f} CPU s  {rates[name]:8.1f} MB/CPU-s")
    runner_up = max(("numpy", "numba"), key=rates.__getitem__)
    print_result(f"minhash_rensa_vs_{runner_up}", rates["rensa"], rates[runner_up], "MB/CPU-s")


if __name__ == "__main__":
    main()
