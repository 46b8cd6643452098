"""The dedupe stage as the flow's summary shows it: :class:`pipeline.dedupe.stage.DedupeStage` through the runner."""

from __future__ import annotations

from typing import Any

from core.rundir import RunPaths
from core.stage import run_stage
from pipeline.config import DedupeConfig
from pipeline.dedupe.stage import DedupeStage


def dedupe_stage(paths: RunPaths, config: DedupeConfig) -> dict[str, Any]:
    """Run exact + near dedupe unless it already ran over exactly these parts with these settings.

    One fingerprint decides (:func:`pipeline.dedupe.stage.dedupe_inputs`, recorded in ``stages/dedupe.json``);
    the summary says whether the work was ``skipped``.
    """
    return run_stage(DedupeStage(paths, config)).as_summary()
