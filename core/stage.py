"""A stage is one type: a name, its typed settings, its declared inputs and outputs, and ``run()``.

:func:`run_stage` is the one function that runs any stage (or one unit of it: an ingest part, a pack
(split, source)). It fingerprints the declared inputs, skips when the marker holds that fingerprint and every
declared output is there, and otherwise runs the stage, which writes its outputs atomically; the marker is
written last. A ``kill -9`` between the outputs and the marker leaves no marker, so the re-run does the work
again (outputs are deterministic: it writes the same bytes). :func:`stage_status` answers, without running
anything, whether a re-run would redo the unit and why (``tokenmill status``).

The marker (``stages/<stage>.json`` or ``stages/<stage>/<unit>.json``) records the fingerprint, the summary
and each input's own digest, so a stale unit can name the file, setting or upstream stage that changed.

Inspired by datatrove's ``PipelineStep`` + executor completion files (a rank is done when its marker exists)
and torchtitan's ``build`` from a typed config; unlike either, a stage here also says *why* it would re-run.
Adding a stage: docs/architecture.md, "How to add a stage".
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from core.errors import RunDirError
from core.files.atomic import read_json
from core.rundir import CODE_VERSION, RunPaths

MARKER_FORMAT = 2
"""Markers that record their inputs (``inputs``): what :func:`stage_status` compares to name a change."""

Progress = Callable[..., None]
"""``progress(done, total[, counts])``: how far a running stage is, in the stage's :attr:`Stage.progress_unit`;
``counts``: running totals of side counts shown with their rates (an ingest part's ``{"records": 1790}``)."""


def _no_progress(done: int, total: int | None, counts: Mapping[str, int] | None = None) -> None:
    """The progress callback of a stage run outside a flow (a test, the Python API)."""


@dataclass(frozen=True)
class Inputs:
    """What a unit's output depends on; the fingerprint covers all of it and tokenmill's CODE_VERSION.

    ``settings``: the typed config section (or the part of it the stage reads), JSON-serialisable.
    ``files``: ``{name: digest}`` of the files read (see :func:`core.rundir.file_stats`; names as the user sees them).
    ``upstream``: ``{"stage" or "stage/unit": fingerprint}`` of the stages whose outputs are read.
    ``version``: the stage's own code version; bump it when the same inputs give other outputs.
    """

    settings: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    upstream: Mapping[str, str] = field(default_factory=dict)
    version: str = "1"

    def digests(self) -> dict[str, str]:
        """One digest per input (``setting:KEY``, ``file:NAME``, ``upstream:STAGE``, ``version``), for reasons."""
        digests = {f"setting:{key}": _digest(value) for key, value in self.settings.items()}
        digests.update({f"file:{name}": str(digest) for name, digest in self.files.items()})
        digests.update({f"upstream:{name}": str(value) for name, value in self.upstream.items()})
        digests["version"] = f"{CODE_VERSION}/{self.version}"
        return dict(sorted(digests.items()))

    def fingerprint(self) -> str:
        return _digest(self.digests())


class Stage(ABC):
    """One step of a run. Subclasses are small: they declare, :func:`run_stage` decides.

    ``name``: the marker's folder, the Prefect task's name, what ``tokenmill status`` prints.
    ``reads``: names of the stages whose outputs it reads (the Prefect graph's edges, the status cascade).
    ``progress_unit``: what ``on_progress`` counts (``bytes``, ``tokens``), or None for a spinner.
    """

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    progress_unit: ClassVar[str | None] = None

    in_worker_process: ClassVar[bool] = False
    """Whether the flow runs it in a worker process (pure-Python work that holds the GIL: ingest)."""
    retries: ClassVar[int] = 0
    """How often the flow retries a failed unit (I/O-bound work only; a user error is never retried)."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths

    @classmethod
    def build(cls, run: Any) -> Stage | None:
        """The stage for a resolved run (``flows.recipe.ResolvedRun``: paths, recipe, base, trust), or None when
        the recipe leaves it out. Subclasses with settings take their typed section from ``run.recipe`` here."""
        return cls(run.paths)

    def units(self) -> Sequence[str | None]:
        """The units run one by one (each its own marker and task run); ``[None]``: the stage is one unit."""
        return [None]

    @abstractmethod
    def inputs(self, unit: str | None) -> Inputs:
        """What this unit's output depends on (cheap: stats and small hashes, never the work itself)."""

    @abstractmethod
    def outputs(self, unit: str | None) -> Sequence[Path]:
        """Files or folders that must exist for a recorded unit to count as done."""

    @abstractmethod
    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        """Do the work, writing every output atomically; return the summary (JSON-serialisable) to record."""

    def label(self, unit: str | None) -> str:
        """How logs, bars and the Prefect UI name the unit: ``dedupe``, ``pack train-stdlib``."""
        return self.name if unit is None else f"{self.name} {unit}"

    def bar(self, unit: str | None) -> str:
        """How the terminal's progress bar names the unit (default: its label)."""
        return self.label(unit)

    def marker_extras(self, unit: str | None, summary: dict[str, Any]) -> dict[str, Any]:
        """Fields the marker keeps beside the summary (an ingest part's ``part``); none by default."""
        return {}

    def pending_reasons(self, unit: str | None) -> list[str]:
        """Why a unit with no marker is to do, where the stage can say more than "never finished" (an ingest part
        planned from new source files names them); none by default."""
        return []

    def status_notes(self) -> list[str]:
        """What ``tokenmill status`` says of the stage beside its units, that a re-run does not redo (a source file
        changed after it was ingested is not re-read); none by default."""
        return []

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """Files changed since the marker ``recorded`` that its fingerprint cannot hold: an output edited (a shard
        whose sha256 is not the recorded one), or an input found only by running (a task's data file, listed in
        the marker). The unit is redone. Missing outputs are the runner's to see; none by default."""
        return []


@dataclass(frozen=True)
class StageResult:
    """What :func:`run_stage` returns: the summary (recorded or new) and whether the work was skipped."""

    stage: str
    unit: str | None
    fingerprint: str
    summary: dict[str, Any]
    skipped: bool

    def as_summary(self) -> dict[str, Any]:
        """The summary as the flows print it: the stage's own keys, then ``skipped``."""
        return {**self.summary, "skipped": self.skipped}


def run_stage(stage: Stage, unit: str | None = None, on_progress: Progress | None = None) -> StageResult:
    """Run ``stage``'s ``unit`` unless its marker holds the inputs' fingerprint and its outputs exist.

    The only place a stage is skipped or its marker written. The old marker is removed before the work
    starts, so a run killed half way can never be vouched for by the previous run's marker.
    """
    inputs = stage.inputs(unit)
    stage_fingerprint = inputs.fingerprint()
    recorded = read_marker(stage.paths, stage.name, unit)
    if recorded is not None and recorded.get("fingerprint") == stage_fingerprint \
            and _missing(stage.outputs(unit)) == [] and stage.changed_since(unit, recorded) == []:
        return StageResult(stage.name, unit, stage_fingerprint, recorded["summary"], skipped=True)
    stage.paths.marker(stage.name, unit).unlink(missing_ok=True)
    summary = stage.run(unit, on_progress or _no_progress)
    stage.paths.write_json(stage.paths.marker(stage.name, unit), {
        "format": MARKER_FORMAT, "fingerprint": stage_fingerprint, "inputs": inputs.digests(), "summary": summary,
        **stage.marker_extras(unit, summary)})
    return StageResult(stage.name, unit, stage_fingerprint, summary, skipped=False)


def read_marker(paths: RunPaths, stage: str, unit: str | None = None) -> dict[str, Any] | None:
    """The marker of (stage, unit), or None when there is none (or it is damaged: the unit is simply redone).

    A marker of the format before this one (no ``inputs``) is refused in one line: its run dir was written by a
    tokenmill that kept markers in other places, and this one does not migrate them.
    """
    marker = paths.marker(stage, unit)
    if not marker.is_file():
        return None
    try:
        record = read_json(marker)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "summary" not in record:
        return None
    if record.get("format") != MARKER_FORMAT:
        raise RunDirError(f"{marker}: written by an older tokenmill (stage markers without inputs); re-run into a "
                          f"fresh run dir (--run-dir NEW), or delete {paths.stages} to redo every stage here.")
    return record


StageState = Literal["done", "stale", "to do"]


@dataclass(frozen=True)
class UnitStatus:
    """Whether a re-run would redo (stage, unit), and why: the inputs that changed or the outputs missing."""

    stage: str
    unit: str | None
    state: StageState
    reasons: tuple[str, ...] = ()
    fingerprint: str = ""
    new_fingerprint: bool = True
    """Whether a re-run records another fingerprint than the marker's (False when it only rewrites a missing
    output from the same inputs): only then do the stages reading this one re-run too."""


def stage_status(stage: Stage, unit: str | None = None) -> UnitStatus:
    """What :func:`run_stage` would do with (stage, unit) now, and why; runs nothing, writes nothing."""
    inputs = stage.inputs(unit)
    stage_fingerprint = inputs.fingerprint()
    recorded = read_marker(stage.paths, stage.name, unit)
    if recorded is None:
        return UnitStatus(stage.name, unit, "to do", tuple(stage.pending_reasons(unit)) or ("never finished",),
                          stage_fingerprint)
    missing = _missing(stage.outputs(unit))
    changed = stage.changed_since(unit, recorded) if not missing else []
    same = recorded.get("fingerprint") == stage_fingerprint
    if same and not missing and not changed:
        return UnitStatus(stage.name, unit, "done", (), stage_fingerprint, new_fingerprint=False)
    reasons = changed_inputs(recorded.get("inputs", {}), inputs.digests())
    reasons += [f"output missing: {_shown(stage.paths, path)}" for path in missing]
    reasons += [f"changed since: {_shown(stage.paths, path)}" for path in changed]
    return UnitStatus(stage.name, unit, "stale", tuple(reasons) or ("inputs changed",), stage_fingerprint,
                      new_fingerprint=not same)


def changed_inputs(recorded: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """``file changed: docs/a.txt``, ``setting changed: vocab_size``, ``upstream changed: dedupe``, …"""
    reasons = []
    for key in sorted(set(recorded) | set(current)):
        if recorded.get(key) == current.get(key):
            continue
        kind, _, name = key.partition(":")
        change = "added" if key not in recorded else "removed" if key not in current else "changed"
        reasons.append(f"{kind} {change}: {name}" if name else f"{kind} {change}")
    return reasons


def _missing(outputs: Sequence[Path]) -> list[Path]:
    return [Path(path) for path in outputs if not Path(path).exists()]


def _shown(paths: RunPaths, path: Path) -> str:
    return path.relative_to(paths.root).as_posix() if path.is_relative_to(paths.root) else str(path)


def _digest(value: Any) -> str:
    payload = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
