"""Stage progress: one line per finished stage call (CI, Prefect UI), and live rich bars on a terminal.

The lines come from :func:`reports_progress`. The bars exist only inside :func:`live_progress` (the CLI
enters it when stderr is a terminal and ``--quiet`` is off); elsewhere, e.g. in a Dask worker,
:func:`stage_meter` hands out a meter that does nothing, so stage code never has to ask.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from prefect import get_run_logger
from prefect.exceptions import MissingContextError
from prefect.logging.handlers import PrefectConsoleHandler
from rich.console import Console
from rich.default_styles import DEFAULT_STYLES
from rich.progress import Progress, Task, TaskID
from rich.theme import Theme

from flows.progress.columns import build_progress
from flows.runtime.settings import QUIET_ENV

P = ParamSpec("P")
R = TypeVar("R")
COUNTERS = (("num_records", "records"), ("num_documents", "docs"), ("num_documents_in", "docs"),
            ("num_train_checked", "docs"), ("num_bytes", "bytes"), ("num_tokens", "tokens"), ("num_rows", "rows"))


# ---- one line per stage call ------------------------------------------------------------------------


def describe_rates(label: str, summary: Any, seconds: float, rates: bool = True) -> str:
    """``ingest-part 3: 1,755 docs, 31.5 MB in 0.70 s (2,507 docs/s, 45.0 MB/s)``; skipped stages say so."""
    if isinstance(summary, list) and summary and all(hasattr(item, "num_tokens") for item in summary):  # shards
        summary = {"num_rows": sum(info.num_rows for info in summary),
                   "num_tokens": sum(info.num_tokens for info in summary)}
    elif isinstance(summary, list):  # planned parts
        return f"{label}: {len(summary)} part(s) to do" if summary else f"{label}: nothing new to do"
    if not isinstance(summary, dict):
        return f"{label}: done in {seconds:.2f} s"
    amounts = [(unit, summary[key]) for key, unit in COUNTERS if isinstance(summary.get(key), int)]
    seen: set[str] = set()
    amounts = [(unit, value) for unit, value in amounts if not (unit in seen or seen.add(unit))]
    done = ", ".join(_amount(unit, value) for unit, value in amounts) or "done"
    if summary.get("skipped") or seconds <= 0 or not rates:
        if summary.get("skipped"):
            return f"{label}: {done + ': ' if amounts else ''}skipped (up to date)"
        return f"{label}: {done}"
    rates = ", ".join(_amount(unit, value / seconds) + "/s" for unit, value in amounts)
    return f"{label}: {done} in {seconds:.2f} s" + (f" ({rates})" if rates else "")


def _amount(unit: str, value: float) -> str:
    if unit == "bytes":
        return f"{value / 1e6:,.1f} MB"
    return f"{value:,.0f} {unit}"


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The task run's logger (console + Prefect UI), or a plain logger outside a Prefect run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tokenmill.progress")


def reports_progress(label: str, rates: bool = True) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: log one line with counts (and rates) when the wrapped stage call returns."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter()
            result = function(*args, **kwargs)
            if not os.environ.get(QUIET_ENV):
                stage_logger().info(describe_rates(label, result, time.perf_counter() - started, rates))
            return result

        return wrapper

    return decorate


# ---- live bars ----------------------------------------------------------------------------------------


class Meter:
    """What a stage call feeds its bar with; without live bars every method does nothing."""

    def __init__(self, board: _Board | None = None, bar: _Bar | None = None) -> None:
        self._board, self._bar = board, bar
        self.advanced = 0
        self.counted: Counter[str] = Counter()

    def advance(self, amount: int, **counts: int) -> None:
        """``amount`` more units of the bar done, plus side counts shown with their rates (``docs=120``)."""
        if self._board is not None and self._bar is not None:
            self.advanced += amount
            self.counted.update(counts)
            self._board.advance(self._bar, amount, counts)

    def update(self, *, completed: int | None = None, total: int | None = None, note: str | None = None) -> None:
        """Set the bar's position, total or note (e.g. ``loss 3.21``) outright."""
        if self._board is not None and self._bar is not None:
            fields = {} if note is None else {"note": note}
            self._board.progress.update(self._bar.task_id, completed=completed, total=total, **fields)

    def restart(self, completed: int) -> None:
        """Start the clock again at ``completed`` (a resumed run): rates count only what this run does."""
        if self._board is not None and self._bar is not None:
            task = self._board.task(self._bar)
            fields = {**task.fields, "resumed_from": completed}
            self._board.progress.reset(self._bar.task_id, completed=completed, total=task.total, **fields)


@dataclass
class _Bar:
    """One rich task; a shared bar is fed by ``calls_left`` concurrent stage calls (e.g. every ingest part)."""

    task_id: TaskID
    calls_left: int = 1
    counts: Counter[str] = field(default_factory=Counter)


class _Board:
    """The live bars of this process, one row per stage name; safe to feed from the task runner's threads.

    A name keeps its row: a retry or a later call of the same stage (``report`` after ``prepare`` and again
    after training, a retried ``train``) starts that row again instead of drawing a second one below it.
    """

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self._shared: dict[str, _Bar] = {}
        self._rows: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def task(self, bar: _Bar) -> Task:
        return next(task for task in self.progress.tasks if task.id == bar.task_id)

    def open_shared(self, name: str, unit: str, total: int, num_calls: int) -> None:
        with self._lock:
            self._shared[name] = _Bar(self._row(name, unit, total), num_calls)

    def join(self, name: str, unit: str | None, total: int | None) -> _Bar:
        """The shared bar ``name`` if one is open, else a bar of the caller's own (on the row of that name)."""
        with self._lock:
            if name in self._shared:
                return self._shared[name]
            return _Bar(self._row(name, unit, total))

    def _row(self, name: str, unit: str | None, total: int | None) -> TaskID:
        """The row ``name``: a new one, or the one an earlier call drew, started again from 0."""
        fields = {"unit": unit, "counts": {}, "note": ""}
        if name not in self._rows:
            self._rows[name] = self.progress.add_task(name, total=total, **fields)
        else:
            self.progress.reset(self._rows[name], total=total, description=name, **fields)
        return self._rows[name]

    def advance(self, bar: _Bar, amount: int, counts: dict[str, int]) -> None:
        with self._lock:
            bar.counts.update(counts)
            self.progress.update(bar.task_id, advance=amount, counts=dict(bar.counts))

    def leave(self, name: str, bar: _Bar, meter: Meter, ended_by: BaseException | None) -> None:
        """A call is over: a failed one takes back what it counted (its retry counts again); the last one ends.

        A call ended by Ctrl-C marks its row ``(interrupted)``, any other error ``(failed)``.
        """
        if ended_by is not None:
            self.advance(bar, -meter.advanced, {key: -value for key, value in meter.counted.items()})
            if bar.calls_left == 1 and self._shared.get(name) is not bar:
                self.stop(bar.task_id, "interrupted" if isinstance(ended_by, KeyboardInterrupt) else "failed")
            return
        with self._lock:
            bar.calls_left -= 1
            if bar.calls_left > 0:
                return
            self._shared.pop(name, None)
        completed = self.task(bar).completed
        self.progress.update(bar.task_id, total=completed, completed=completed)
        self.progress.stop_task(bar.task_id)

    def stop(self, task_id: TaskID, why: str) -> None:
        """Stop a row where it is, its name followed by ``(why)``."""
        name = next(name for name, row in self._rows.items() if row == task_id)
        self.progress.update(task_id, description=f"{name} ({why})")
        self.progress.stop_task(task_id)

    def interrupt(self) -> None:
        """Ctrl-C ended the command: every row still running reads ``(interrupted)``, not a failure."""
        for task in self.progress.tasks:
            if not task.finished and task.description in self._rows:
                self.stop(task.id, "interrupted")


_LIVE: dict[str, _Board] = {}
"""The process's board while :func:`live_progress` runs (a dict, so no ``global`` statement is needed)."""


def open_shared_bar(name: str, unit: str, total: int, num_calls: int) -> None:
    """Announce one bar that ``num_calls`` stage calls named ``name`` will feed together (a no-op if none live)."""
    board = _LIVE.get("board")
    if board is not None and num_calls > 0:
        board.open_shared(name, unit, total, num_calls)


@contextlib.contextmanager
def stage_meter(name: str, unit: str | None = None, total: int | None = None) -> Iterator[Meter]:
    """A meter for one stage call: it joins the shared bar ``name`` if one is open, else gets a bar of its own.

    ``unit`` is ``bytes`` (shown as MB), another plural noun (``tokens``, ``steps``) or None (a spinner).
    """
    board = _LIVE.get("board")
    if board is None:
        yield Meter()
        return
    bar = board.join(name, unit, total)
    meter = Meter(board, bar)
    try:
        yield meter
    except BaseException as err:
        board.leave(name, bar, meter, ended_by=err)
        raise
    board.leave(name, bar, meter, ended_by=None)


def shows_bar(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: a spinner with the elapsed time while a stage without finer progress runs."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with stage_meter(name):
                return function(*args, **kwargs)

        return wrapper

    return decorate


@contextlib.contextmanager
def live_progress(console: Console | None = None,
                  get_time: Callable[[], float] | None = None) -> Iterator[Progress | None]:
    """Show stage bars while the block runs, when the console is a terminal and not ``--quiet``.

    Yields the bars (None when there are none). They draw on the console of Prefect's console handler, so
    Prefect's log lines (and anything else written to stderr meanwhile) print above them, not through them.
    """
    console = console or _prefect_console() or Console(stderr=True)
    if os.environ.get(QUIET_ENV) or not console.is_terminal or console.is_dumb_terminal or "board" in _LIVE:
        yield None
        return
    # Prefect's console has a theme of its own (inherit=False): lend it rich's bar and progress styles.
    console.push_theme(Theme({name: style for name, style in DEFAULT_STYLES.items()
                              if name.startswith(("bar.", "progress."))}, inherit=False))
    try:
        with build_progress(console, get_time) as progress:
            board = _LIVE["board"] = _Board(progress)
            try:
                yield progress
            except KeyboardInterrupt:
                board.interrupt()
                raise
            finally:
                del _LIVE["board"]
    finally:
        console.pop_theme()


def _prefect_console() -> Console | None:
    """The rich console Prefect's console handler prints log lines with (None when logging is configured away)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            return handler.console
    return None
