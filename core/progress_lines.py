"""Progress lines: how a process tokenmill launches (the whole-split evaluation) tells the flow how far it got.

The launched process prints ``tokenmill-progress {"done": 1200, "total": 5000, "unit": "rows"}`` on stdout; the
flow reads its output line by line anyway (:func:`flows.runtime.subprocess_log.run_streaming`), turns such a line into a
bar update on a terminal and leaves it out of the log (a log gets the process's finishing line instead). The
numbers are parsed as JSON numbers, never run or formatted into anything.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

PREFIX = "tokenmill-progress "
PRINT_EVERY_S = 2.0
"""A launched process prints a progress line at most this often (and always the last one)."""


@dataclass(frozen=True)
class ProgressLine:
    done: int
    total: int
    unit: str


def progress_line(done: int, total: int, unit: str) -> str:
    """The line for ``done`` of ``total`` ``unit`` (a plural noun: ``rows``)."""
    return PREFIX + json.dumps({"done": int(done), "total": int(total), "unit": unit})


def parse_progress_line(line: str) -> ProgressLine | None:
    """The progress a line reports, or None for any other line (one that merely starts like one included)."""
    if not line.startswith(PREFIX):
        return None
    try:
        fields = json.loads(line[len(PREFIX):])
        done, total, unit = fields["done"], fields["total"], fields["unit"]
    except (ValueError, KeyError, TypeError):
        return None
    if not (isinstance(done, int) and isinstance(total, int) and isinstance(unit, str)):
        return None
    return ProgressLine(done, total, unit)


@dataclass
class ProgressPrinter:
    """A callback ``(done, total)`` that prints progress lines: at most one per PRINT_EVERY_S, and the last."""

    unit: str
    out: TextIO = field(default_factory=lambda: sys.stdout)
    clock: Callable[[], float] = time.monotonic
    _printed_at: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and self._printed_at is not None and now - self._printed_at < PRINT_EVERY_S:
            return
        self._printed_at = now
        print(progress_line(done, total, self.unit), file=self.out, flush=True)
