"""Serve the deployments of ``prefect.yaml`` locally with their schedules (no work pool needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError

PREFECT_YAML = Path(__file__).resolve().parent.parent / "prefect.yaml"


def load_deployment_specs(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    """The ``deployments`` of prefect.yaml (one source of truth for `prefect deploy` and `tokenmill serve`)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no prefect.yaml; run tokenmill serve from a tokenmill checkout.")
    specs = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("deployments") or []
    if not specs:
        raise ConfigError(f"{path}: no deployments listed.")
    return specs


SERVED_SUFFIX = "-served"
"""Served deployments are ``<name>-served`` (``data-to-model/nightly-refresh-served``): `prefect deploy --all`
registers prefect.yaml's names with their work pool, and one registration under the same name would replace
the other's work pool and parameters without a word."""


def serve_deployments(recipe: str | None = None, run_dir: str | None = None, limit: int = 1) -> None:
    """Block, serving every deployment; ``recipe``/``run_dir`` override the yaml's default parameters."""
    from prefect import serve  # Prefect (~3 s): only `tokenmill serve`

    serve(*served_deployments(recipe, run_dir), limit=limit)


def served_deployments(recipe: str | None = None, run_dir: str | None = None) -> list[Any]:
    """prefect.yaml's deployments of ``data-to-model`` as ``tokenmill serve`` registers them: named apart
    (SERVED_SUFFIX), with their schedules, ``recipe``/``run_dir`` overriding the yaml's parameters."""
    from flows.pipeline import data_to_model  # Prefect and every stage: only `tokenmill serve`

    deployments = []
    for spec in load_deployment_specs():
        parameters = dict(spec.get("parameters") or {})
        if recipe is not None:
            parameters["recipe"] = recipe
        if run_dir is not None:
            parameters["run_dir"] = run_dir
        deployments.append(data_to_model.to_deployment(
            name=spec["name"] + SERVED_SUFFIX, description=spec.get("description"), parameters=parameters,
            schedules=cron_schedules(spec),
        ))
    return deployments


def cron_schedules(spec: dict[str, Any]) -> list[Any]:
    """The deployment's active cron schedules with their time zones (as `prefect deploy` reads them)."""
    from prefect.schedules import Cron  # Prefect (~3 s): only `tokenmill serve`

    return [Cron(schedule["cron"], timezone=schedule.get("timezone"), day_or=schedule.get("day_or", True))
            for schedule in spec.get("schedules") or [] if "cron" in schedule and schedule.get("active", True)]
