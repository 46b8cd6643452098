"""What an ingest worker needs, imported and warmed once by the fork server its pool forks workers from.

``flows.runtime.stage_processes`` forks each worker from a server process that imported this module first: the
modules (Arrow, numba, DuckDB, the readers and filters) and numba's machine code for the compiled loops
are then pages the workers share instead of ~200 MB each. numba loads a loop's machine code on its first
call (compiling it if no cache exists yet), so the loops are called here once, on a few words, one of them
non-ASCII: that builds the normalised words' code point tables (4.5 MB) once for all workers. The language
model (fastText lid.176.ftz, ~6 MB) is loaded too, so a manifest with ``filters.language`` costs the workers
nothing more; loading it does not turn the filter on. Both together: importing this module went from 1.17 to
1.73 s and 270 to 279 MB RSS (measured on a shared 2-core machine).
"""

from __future__ import annotations

import pyarrow as pa

import pipeline.ingest.stage  # noqa: F401  (the stage itself, its readers and filters)
from pipeline.dedupe import kernels, minhash, near_dedupe  # noqa: F401  (near_dedupe: ingest's signatures)
from pipeline.filters import language


def _warm_compiled_loops() -> None:
    minhash.signatures(pa.array(["one two three four five six", "Straße café"]), num_perm=8, ngram=5)
    kernels.collapse_whitespace(b"one  two\tthree")
    language.detector()


_warm_compiled_loops()
