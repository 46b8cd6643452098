"""How the live stage bars look: rich progress columns sized to fit an 80-column terminal."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.table import Column
from rich.text import Text

SPEED_WINDOW_S = 120.0
"""Rates and ETAs average over this window: the trainer prints a step line only every ``log_every`` steps."""


def build_progress(console: Console, get_time: Callable[[], float] | None = None) -> Progress:
    """Rows like ``ingest ━━━━━━╺━━━ 12.0/31.5 MB 4.1 MB/s 0:03 eta 0:05 1,234 docs (411 docs/s)``.

    Every column but the last keeps to one line; the last (side counts, loss) takes what width is left and
    is cut with an ellipsis on a narrow terminal.
    """
    fixed = Column(no_wrap=True)
    return Progress(TextColumn("{task.description}", markup=False, table_column=fixed),
                    BarColumn(bar_width=16, table_column=fixed), AmountColumn(table_column=fixed),
                    RateColumn(table_column=fixed), TimeColumn(table_column=fixed),
                    DetailColumn(table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
                    console=console, get_time=get_time, speed_estimate_period=SPEED_WINDOW_S, expand=True,
                    refresh_per_second=4)


class AmountColumn(ProgressColumn):
    """``12.0/31.5 MB``, ``120/400 steps``, or ``8.8M tokens`` while the total is unknown and once done."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit")
        if unit is None:
            return Text("")
        done = format_amount(unit, task.completed)
        if task.total is not None and not task.finished:
            done = f"{done.split(' ')[0]}/{format_amount(unit, task.total)}"
        return Text(done, style="progress.download")


class RateColumn(ProgressColumn):
    """Units per second: over the last SPEED_WINDOW_S while running, the whole stage's average once done.

    The average counts from the field ``resumed_from`` (where a resumed run began), not from 0.
    """

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit")
        done = task.completed - task.fields.get("resumed_from", 0)
        speed = done / task.finished_time if task.finished and task.finished_time else task.speed
        if unit is None or speed is None:
            return Text("")
        return Text(format_rate(unit, speed), style="progress.data.speed")


class TimeColumn(ProgressColumn):
    """Elapsed time, and ``eta M:SS`` while a bar with a total runs."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        text = Text(format_duration(elapsed or 0.0), style="progress.elapsed")
        if not task.finished and task.total is not None and task.time_remaining is not None:
            text.append(f" eta {format_duration(task.time_remaining)}", style="progress.remaining")
        return text


class DetailColumn(ProgressColumn):
    """Side counts with their average rates (``1,234 docs (411 docs/s)``), then the stage's note."""

    def render(self, task: Task) -> Text:
        seconds = (task.finished_time if task.finished else task.elapsed) or 0.0
        parts = [f"{value:,} {unit}" + (f" ({format_rate(unit, value / seconds)})" if seconds > 0 else "")
                 for unit, value in task.fields.get("counts", {}).items()]
        if task.fields.get("note"):
            parts.append(task.fields["note"])
        return Text(" · ".join(parts))


def format_amount(unit: str, value: float) -> str:
    """``31.5 MB``, ``400 steps``, ``8.8M tokens``: at most about 4 significant digits."""
    if unit == "bytes":
        return f"{value / 1e6:,.1f} MB"
    return f"{_compact(value)} {unit}"


def format_rate(unit: str, per_second: float) -> str:
    """``4.1 MB/s``, ``2.5 steps/s``, ``386k tokens/s``."""
    if unit == "bytes":
        return f"{per_second / 1e6:,.1f} MB/s" if per_second < 1e8 else f"{per_second / 1e6:,.0f} MB/s"
    return f"{per_second:.1f} {unit}/s" if per_second < 10 else f"{_compact(per_second)} {unit}/s"


def format_duration(seconds: float) -> str:
    """``0:07``, ``12:34``, ``1:02:03``."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _compact(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e5:
        return f"{value / 1e3:.0f}k"
    return f"{value:,.0f}"
