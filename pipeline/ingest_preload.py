"""What an ingest worker needs, imported and warmed once by the fork server its pool forks workers from.

``flows.stage_processes`` forks each worker from a server process that imported this module first: the
modules (Arrow, numba, DuckDB, the readers and filters) and numba's machine code for the compiled loops
are then pages the workers share instead of ~200 MB each. numba loads a loop's machine code on its first
call (compiling it if no cache exists yet), so the loops are called here once, on a few words.
"""

from __future__ import annotations

import pyarrow as pa

import pipeline.ingest  # noqa: F401  (the stage itself, its readers and filters)
from pipeline import kernels, minhash, near_dedupe  # noqa: F401  (near_dedupe: what ingest imports for signatures)


def _warm_compiled_loops() -> None:
    minhash.signatures(pa.array(["one two three four five six"]), num_perm=8, ngram=5)
    kernels.collapse_whitespace(b"one  two\tthree")


_warm_compiled_loops()
