"""``tokenmill status``: every stage and unit of a run — done, stale (and why) or to do — and what a re-run redoes.

Decided the way :func:`core.stage.run_stage` decides, from the same declarations, without running anything,
starting Prefect or importing torch. A unit whose inputs did not change is still redone when a stage it reads
re-runs with new inputs (its upstream fingerprint will change); a unit that only lost an output is rewritten
from the same inputs, which changes nothing downstream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.errors import TokenmillError
from core.stage import Stage, UnitStatus, stage_status


@dataclass(frozen=True)
class RunStatus:
    """The status of every unit of the stages, in run order."""

    units: tuple[UnitStatus, ...]

    @property
    def redo(self) -> list[str]:
        """What a re-run would do, as ``stage`` or ``stage unit`` (the task runs' names), in run order."""
        return [_label(status) for status in self.units if status.state != "done"]

    @property
    def up_to_date(self) -> bool:
        return not self.redo

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(stage, unit, state, reasons)`` for a table."""
        return [(status.stage, status.unit or "", status.state, "; ".join(status.reasons)) for status in self.units]

    def as_json(self) -> dict[str, Any]:
        return {"up_to_date": self.up_to_date, "redo": self.redo,
                "units": [{"stage": status.stage, "unit": status.unit, "state": status.state,
                           "reasons": list(status.reasons)} for status in self.units]}


def run_status(stages: Iterable[Stage]) -> RunStatus:
    """The status of each unit of ``stages`` (built for one run, in run order), the upstream cascade applied."""
    statuses: list[UnitStatus] = []
    rerun: set[str] = set()  # stages with a unit that records a new fingerprint
    for stage in stages:
        for unit in _units(stage):
            status = stage_status(stage, unit)
            upstream = [name for name in stage.reads if name in rerun]
            if status.state == "done" and upstream:
                status = replace(status, state="stale", reasons=tuple(f"upstream re-runs: {name}" for name in upstream),
                                 new_fingerprint=True)
            elif status.state != "done" and upstream:
                status = replace(status, reasons=(*status.reasons, *(f"upstream re-runs: {n}" for n in upstream)))
            if status.state != "done" and (status.new_fingerprint or upstream):
                rerun.add(stage.name)
            statuses.append(status)
    return RunStatus(tuple(statuses))


def _units(stage: Stage) -> Sequence[str | None]:
    try:
        return stage.units()
    except TokenmillError as err:
        raise TokenmillError(f"status of {stage.name}: {err}") from err


def _label(status: UnitStatus) -> str:
    return status.stage if status.unit is None else f"{status.stage} {status.unit}"
