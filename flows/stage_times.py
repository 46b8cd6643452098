"""What each stage call leaves for the report: its wall-clock span and the package versions it ran with.

A task decorated with :func:`times_stage` appends ``{stage, start_unix_s, end_unix_s}`` to
``metrics/stage_times.jsonl`` when it returns, and rewrites ``metrics/versions.json`` when a version changed.
:func:`stage_wall_times` merges the spans per stage: calls that overlap (ingest parts on every core) count once,
and the calls of every run of the run dir (a resume, a refresh) add up.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import platform
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, ParamSpec, TypeVar

from core.rundir import CODE_VERSION, RunPaths, path_inside_run

P = ParamSpec("P")
R = TypeVar("R")
PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "safetensors", "datasets", "pyarrow", "duckdb",
            "numpy", "prefect", "lm_eval")
"""Packages whose versions the report lists (those installed): the ones that decide what a run computes."""


def times_stage(stage: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator for a task taking ``paths: RunPaths``: record the call's span under ``stage`` when it returns.

    A call that raises records nothing: the run dir of a failed precondition stays as it was.
    """

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.time()
            result = function(*args, **kwargs)
            paths = signature.bind(*args, **kwargs).arguments["paths"]
            record_stage_time(paths, stage, start, time.time())
            return result

        return wrapper

    return decorate


def record_stage_time(paths: RunPaths, stage: str, start_unix_s: float, end_unix_s: float) -> None:
    """Append one span to ``metrics/stage_times.jsonl`` and keep ``metrics/versions.json`` current."""
    row = {"stage": stage, "start_unix_s": round(start_unix_s, 3), "end_unix_s": round(end_unix_s, 3)}
    paths.append_text(paths.stage_times, json.dumps(row) + "\n")
    versions = installed_versions()
    if read_versions(paths) != versions:  # rewritten only on a change: the report re-renders when it is
        paths.write_json(paths.versions, versions)


def installed_versions() -> dict[str, str]:
    """``{"tokenmill": …, "python": …, package: version}`` for the installed PACKAGES (metadata only, no import)."""
    return dict(_installed_versions())


@functools.cache
def _installed_versions() -> dict[str, str]:
    """Read once per process: each lookup scans the environment's metadata (~20 ms), and every stage asks."""
    found = {"tokenmill": CODE_VERSION, "python": platform.python_version()}
    for package in PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def read_versions(paths: RunPaths) -> dict[str, str]:
    """The recorded versions; ``{}`` before any stage ran, or when the file is not a JSON object of strings or
    leads outside the run dir."""
    if not path_inside_run(paths.root, paths.versions):
        return {}
    try:
        record = json.loads(paths.versions.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {str(key): str(value) for key, value in record.items()}


def stage_wall_times(paths: RunPaths) -> list[dict[str, Any]]:
    """``[{stage, wall_s, calls}]`` in the order stages first ran: the union of each stage's call spans.

    Torn or foreign lines (a writer killed mid-line, a hand edit) are left out.
    """
    spans: dict[str, list[tuple[float, float]]] = {}
    for row in _rows(paths):
        spans.setdefault(row["stage"], []).append((row["start_unix_s"], row["end_unix_s"]))
    return [{"stage": stage, "wall_s": round(merged_seconds(intervals), 3), "calls": len(intervals)}
            for stage, intervals in spans.items()]


def merged_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals: overlapping time counts once."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


def _rows(paths: RunPaths) -> list[dict[str, Any]]:
    if not path_inside_run(paths.root, paths.stage_times):
        return []
    try:
        lines = paths.stage_times.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if _is_span(row):
                rows.append(row)
    return rows


def _is_span(row: Any) -> bool:
    if not isinstance(row, dict) or not isinstance(row.get("stage"), str):
        return False
    start, end = row.get("start_unix_s"), row.get("end_unix_s")
    numbers = all(isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                  for value in (start, end))
    return numbers and start <= end
