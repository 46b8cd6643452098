"""Alternating timed rounds: each variant runs once per round, in turn, so a shared machine's load hits all alike.

The rate of a variant is the units of one pass (what its runner returns: pairs, trained tokens) over the median
round's seconds, per wall second and per CPU second of this process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_rates(runners: dict[str, Callable[[], int]], rounds: int) -> dict[tuple[str, str], float]:
    """(variant, clock) -> units per second of the median round; one untimed warm-up pass each."""
    units = {name: run() for name, run in runners.items()}
    times: dict[tuple[str, str], list[float]] = {(name, clock): [] for name in runners for clock in CLOCKS}
    for _ in range(rounds):
        for name, run in runners.items():
            starts = {clock: read() for clock, read in CLOCKS.items()}
            run()
            for clock, read in CLOCKS.items():
                times[(name, clock)].append(read() - starts[clock])
    return {(name, clock): units[name] / statistics.median(values) for (name, clock), values in times.items()}
