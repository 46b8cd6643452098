"""``tokenmill status``: every stage and unit of a run — done, stale (and why) or to do — and what a re-run redoes.

Decided the way :func:`core.stage.run_stage` decides, from the same declarations, without running anything,
starting Prefect or importing torch. A unit whose inputs did not change is still redone when a stage it reads
re-runs with new inputs and its inputs name that stage or files (its upstream fingerprint or files will change);
a unit that only lost an output is rewritten from the same inputs, which changes nothing downstream.
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
    notes: tuple[str, ...] = ()
    """What the stages say beside their units, that a re-run does not redo (``ingest: sources not listed …``)."""

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
                           "reasons": list(status.reasons)} for status in self.units],
                "notes": list(self.notes)}


def run_status(stages: Iterable[Stage]) -> RunStatus:
    """The status of each unit of ``stages`` (built for one run, in run order), the upstream cascade applied."""
    statuses: list[UnitStatus] = []
    notes: list[str] = []
    rerun: set[str] = set()  # stages with a unit that records a new fingerprint
    for stage in stages:
        units = _units(stage)
        notes += [f"{stage.name}: {note}" for note in stage.status_notes()]
        for unit in units:
            status = stage_status(stage, unit)
            if status.state == "done":
                upstream = _upstream_reruns(stage, unit, rerun)
                if upstream:
                    status = replace(status, state="stale", reasons=(_upstream_reason(upstream),),
                                     new_fingerprint=True)
            elif upstream := [name for name in stage.reads if name in rerun]:
                status = replace(status, reasons=(*status.reasons, _upstream_reason(upstream)))
            if status.state != "done" and (status.new_fingerprint or upstream):
                rerun.add(stage.name)
            statuses.append(status)
    return RunStatus(tuple(statuses), tuple(notes))


def _upstream_reruns(stage: Stage, unit: str | None, rerun: set[str]) -> list[str]:
    """The re-running stages a done unit reads whose new outputs change its fingerprint: those its inputs name
    (``upstream``), and every one when it reads files (a re-run may add or rewrite them). A unit that declares
    neither (a tokenizer kept as trained, a decontamination switched off) keeps its fingerprint: the re-run skips
    it, and so does this."""
    candidates = [name for name in stage.reads if name in rerun]
    if not candidates:
        return []
    inputs = stage.inputs(unit)
    named = {key.split("/")[0] for key in inputs.upstream}
    return [name for name in candidates if name in named or inputs.files]


def _upstream_reason(upstream: list[str]) -> str:
    return f"upstream re-runs: {', '.join(upstream)}"


def _units(stage: Stage) -> Sequence[str | None]:
    try:
        return stage.units()
    except TokenmillError as err:
        raise TokenmillError(f"status of {stage.name}: {err}") from err


def _label(status: UnitStatus) -> str:
    return status.stage if status.unit is None else f"{status.stage} {status.unit}"
