"""One progress line per finished stage call, with rates: readable in CI logs, Prefect's UI and a terminal."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

P = ParamSpec("P")
R = TypeVar("R")
QUIET_ENV = "TOKENMILL_QUIET"
COUNTERS = (("num_records", "records"), ("num_documents", "docs"), ("num_documents_in", "docs"),
            ("num_bytes", "bytes"), ("num_tokens", "tokens"), ("num_rows", "rows"))


def describe_rates(label: str, summary: Any, seconds: float, rates: bool = True) -> str:
    """``ingest-part 3: 1,755 docs, 31.5 MB in 0.70 s (2,507 docs/s, 45.0 MB/s)``; skipped stages say so."""
    if isinstance(summary, list) and all(hasattr(item, "num_tokens") for item in summary):  # ShardInfo rows
        summary = {"num_rows": sum(info.num_rows for info in summary),
                   "num_tokens": sum(info.num_tokens for info in summary)}
    elif isinstance(summary, list):  # planned parts
        return f"{label}: {len(summary)} part(s) to do"
    if not isinstance(summary, dict):
        return f"{label}: done in {seconds:.2f} s"
    amounts = [(unit, summary[key]) for key, unit in COUNTERS if isinstance(summary.get(key), int)]
    seen: set[str] = set()
    amounts = [(unit, value) for unit, value in amounts if not (unit in seen or seen.add(unit))]
    done = ", ".join(_amount(unit, value) for unit, value in amounts) or "done"
    if summary.get("skipped") or seconds <= 0 or not rates:
        return f"{label}: {done} (already done, skipped)" if summary.get("skipped") else f"{label}: {done}"
    rates = ", ".join(_amount(unit, value / seconds) + "/s" for unit, value in amounts)
    return f"{label}: {done} in {seconds:.2f} s" + (f" ({rates})" if rates else "")


def _amount(unit: str, value: float) -> str:
    if unit == "bytes":
        return f"{value / 1e6:,.1f} MB"
    return f"{value:,.0f} {unit}"


def _logger() -> logging.Logger | logging.LoggerAdapter:
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
                _logger().info(describe_rates(label, result, time.perf_counter() - started, rates))
            return result

        return wrapper

    return decorate
