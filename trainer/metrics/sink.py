"""Metrics sink: training/eval measurements -> ``metrics/train.jsonl`` and ``metrics/eval.jsonl`` (one JSON row a line).

Rows are appended and flushed as they happen, so a killed run keeps what it measured. On resume the
rows past the resumed step are dropped first: steps replayed after a restart are never counted twice.
The numeric columns also go to a tracker when one is given (``train.trackers``,
:class:`trainer.metrics.trackers.Trackers`, as ``train/<column>`` and ``eval/<column>``); the JSONL files stay the
record DuckDB reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.layout import RELATIVE
from core.rundir import RunPaths

TRAIN_FILE, EVAL_FILE = RELATIVE.train_metrics.name, RELATIVE.eval_metrics.name
"""The metrics files' names in ``metrics/`` (what flows.progress.training tails)."""


Tracker = Callable[..., None]
"""``tracker(values: dict[str, float], step=int)``, e.g. :meth:`trainer.metrics.trackers.Trackers.log`."""


class MetricsSink:
    """Writes metric rows into the run's ``metrics/`` when ``enabled`` (rank 0); a no-op on the other ranks."""

    def __init__(self, paths: RunPaths, enabled: bool = True, tracker: Tracker | None = None) -> None:
        self.paths = paths
        self.enabled = enabled
        self.tracker = tracker

    def drop_rows_after(self, step: int | None) -> None:
        """Keep only rows with ``step <= step``; ``None`` (a fresh start) drops every row."""
        if not self.enabled:
            return
        for path in (self.paths.train_metrics, self.paths.eval_metrics):
            if path.is_file():
                kept = [row for row in read_metric_rows(path) if step is not None and row["step"] <= step]
                self.paths.write_text(path, "".join(_to_line(row) for row in kept))

    def log_train(self, row: dict[str, Any]) -> None:
        self._append(self.paths.train_metrics, row)
        self._track("train", row)

    def log_eval(self, row: dict[str, Any]) -> None:
        self._append(self.paths.eval_metrics, row)
        self._track("eval", row)

    def _track(self, prefix: str, row: dict[str, Any]) -> None:
        if not self.enabled or self.tracker is None:
            return
        values = {f"{prefix}/{key}": value for key, value in row.items() if key != "step"
                  and isinstance(value, int | float) and math.isfinite(value)}
        self.tracker(values, step=row["step"])

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        if self.enabled:  # a torn last line (killed mid-append) is skipped by read_metric_rows
            self.paths.append_text(path, _to_line(row))


def read_metric_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics JSONL file; a torn last line (the writer was killed mid-write) is skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def _to_line(row: dict[str, Any]) -> str:
    # NaN/inf are not JSON: write null so DuckDB and other strict readers can still parse the file.
    clean = {key: None if isinstance(value, float) and not math.isfinite(value) else value
             for key, value in row.items()}
    return json.dumps(clean, sort_keys=True) + "\n"
