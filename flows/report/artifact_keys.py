"""Prefect artifact keys per run: ``<run>-<artifact>``, so two runs on one server never overwrite each other's.

A key names an artifact's history in the Prefect UI: each run dir keeps its own (``tiny-data-funnel``), and a
re-run of the same run dir adds a version to it. Prefect accepts lowercase letters, digits and dashes only.
"""

from __future__ import annotations

import re
from pathlib import Path

NOT_IN_KEY = re.compile(r"[^a-z0-9]+")


def run_key_prefix(run_dir: str | Path) -> str:
    """The run dir's folder name (``runs/<recipe name>`` by default) as a key part: lowercased, every run of
    other characters one dash, no dash at either end; ``run`` when nothing is left (``My_Run.v2`` ->
    ``my-run-v2``)."""
    return NOT_IN_KEY.sub("-", Path(run_dir).name.lower()).strip("-") or "run"


def artifact_key(run_dir: str | Path, artifact: str) -> str:
    """``<run>-<artifact>``: the key of ``artifact`` (``data-funnel``, ``run-summary``, …) for this run dir."""
    return f"{run_key_prefix(run_dir)}-{artifact}"
