"""A cache of the summary a command printed, valid while every stage it covers is done: no flow run to say so.

A fully skipped ``tokenmill run`` spent ~10 s on orchestration alone (the temporary server, Prefect's imports,
~20 flow and task runs reported to it) to learn, stage by stage, that nothing had changed. The stages can say
that without Prefect: :func:`flows.status.run_status` asks each unit of the command's stages what
:func:`core.stage.run_stage` would do, from the same declarations (``tokenmill status``). So when ``run``,
``prepare`` or ``train`` finishes with every one of its units done, it records a *seal*: the summary it printed
and a digest of each unit's fingerprint. A later call of the same command whose stages are all done, with the
same fingerprints, prints that summary again and exits in about a second, with no flow run. Otherwise (a unit
to do or stale, or done with other fingerprints than the printed summary was made from) it runs its flow.

The seal has no skip rule of its own: it skips exactly when every stage would skip. A change no stage reads
(a newer library, a comment in a manifest, a training setting for ``prepare``) keeps it, as it keeps every
stage skipped. A run whose evaluation left a failed result is not sealed: the failed unit wrote no marker, so
it is still to do (the next run retries it).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from core.errors import TokenmillError
from core.files.atomic import read_json
from core.rundir import fingerprint, path_inside_run
from core.stage import Stage
from flows.recipe import ResolvedRun
from flows.report.stage import ReportStage
from flows.stage_list import ALL_STAGES, EVAL_STAGES, PREPARE_STAGES, TRAIN_STAGES, build_stages
from flows.status import RunStatus, run_status

SEAL_VERSION = 2
"""Version 1 sealed a fingerprint of every input file; such a seal is no seal (the next call takes the flow)."""

COMMAND_STAGES: dict[str, tuple[type[Stage], ...]] = {
    "prepare": PREPARE_STAGES,
    "train": (*TRAIN_STAGES, *EVAL_STAGES, ReportStage),  # the eval stages build to None when eval is off
    "run": ALL_STAGES,
}
"""The stages each sealed command runs, as its flow builds them."""


def sealed_summary(run: ResolvedRun, command: str) -> dict[str, Any] | None:
    """The summary ``command`` printed when it last finished, if every stage it runs is done with the
    fingerprints it finished with; else None.

    Call it holding the run dir's lock (no other process is writing the run dir).
    """
    seal_file = run.paths.command_seal(command)
    if not seal_file.is_file() or not path_inside_run(run.paths.root, seal_file):
        return None
    try:
        seal = read_json(seal_file)
    except (OSError, ValueError):
        return None  # a damaged seal only costs the full path, which rewrites it
    if not isinstance(seal, dict) or seal.get("version") != SEAL_VERSION or not isinstance(seal.get("summary"), str):
        return None
    try:
        status = command_status(run, command)
    except TokenmillError:
        return None  # a run dir a stage cannot read: the flow says why, as it would with no seal
    if not status.up_to_date or seal.get("units") != units_fingerprint(status):
        return None
    try:
        summary = json.loads(_with_run_dir(seal["summary"], run.paths.root))
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


def write_seal(run: ResolvedRun, command: str, summary: dict[str, Any]) -> bool:
    """Record ``summary`` (JSON-serialisable) as what ``command`` prints while its stages stay as they are now,
    if every one of them is done; returns whether it did (a unit to do or stale: no seal).

    The summary is kept in its skipped form (:func:`as_skipped`), as JSON text: the order of its keys is the
    flow's, not write_json's sorted one. The run dir's own path in it (``run_dir``, ``report``, ``model_dir``)
    is kept as RUN_DIR_MARK: a run dir holds no absolute path of its own.
    """
    status = command_status(run, command)
    if not status.up_to_date:
        return False
    text = json.dumps(as_skipped(summary), default=str)
    run.paths.write_json(run.paths.command_seal(command), {
        "version": SEAL_VERSION, "command": command, "sealed_unix_s": round(time.time(), 3),
        "units": units_fingerprint(status), "summary": _without_run_dir(text, run.paths.root)})
    return True


def command_status(run: ResolvedRun, command: str) -> RunStatus:
    """The status of every unit of ``command``'s stages, built as ``tokenmill status`` builds them."""
    return run_status(build_stages(COMMAND_STAGES[command], run))


def units_fingerprint(status: RunStatus) -> str:
    """One digest of every unit's (stage, unit, fingerprint): a unit added, removed or done with other inputs
    (a refresh, a new checkpoint evaluated) changes it."""
    return fingerprint("seal", SEAL_VERSION, sorted((unit.stage, unit.unit or "", unit.fingerprint)
                                                    for unit in status.units))


RUN_DIR_MARK = "${RUN_DIR}"
"""Where a seal's summary named the run dir; the run dir it is read from takes its place."""


def _run_dir_in_json(root: Path) -> re.Pattern[str]:
    """The run dir's path as it appears in JSON text, as a whole path (``/x/run`` never matches ``/x/run2``)."""
    return re.compile(re.escape(json.dumps(str(root))[1:-1]) + r'(?=["/])')


def _without_run_dir(text: str, root: Path) -> str:
    return _run_dir_in_json(root).sub(lambda _: RUN_DIR_MARK, text)


def _with_run_dir(text: str, root: Path) -> str:
    return text.replace(RUN_DIR_MARK, json.dumps(str(root))[1:-1])


def as_skipped(summary: Any) -> Any:
    """``summary`` as a re-run that skips every stage returns it: no parts ingested, every stage ``skipped``.

    A skipped stage returns its recorded summary (its marker's, written with sorted keys) with ``"skipped": True``
    last, in place of the ``False`` it returned when it did the work; tests/test_readme_commands.py holds this
    equal to a skipped flow's own summary.
    """
    if isinstance(summary, list):
        return [as_skipped(item) for item in summary]
    if not isinstance(summary, dict):
        return summary
    if "skipped" in summary:  # a stage's summary: as its marker holds it
        recorded = json.loads(json.dumps({k: v for k, v in summary.items() if k != "skipped"}, sort_keys=True))
        return {**recorded, "skipped": True}
    skipped = {key: as_skipped(value) for key, value in summary.items()}
    if "parts_ingested" in skipped:
        skipped["parts_ingested"] = 0
    return skipped
