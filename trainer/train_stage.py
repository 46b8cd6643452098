"""The training stage: ``accelerate launch … -m trainer.train`` to a target step, skipped when that is done.

The stage decides its own "nothing to do" from its declarations (:func:`core.stage.run_stage`): the trainer's
sections and the target step (settings), the shard index it reads (its file and the shard-index stage's
fingerprint), the tokenizer's and base model's fingerprints (upstream); its outputs are the checkpoint at the
target step (or a later one: a refresh trained past ``max_steps``) with its manifest, and the export in
``model/``. The checkpoint format (manifest written last) is a file format, not a skip rule: the trainer still
restores the newest complete checkpoint and says "nothing to train" when it is there already.

Prefect-free and torch-free at import (``tokenmill status`` builds every stage). How the child's lines and the
training progress are shown is the launcher's business: a flow sets :attr:`TrainStage.launcher` to one that
streams the lines to the task run's log and follows the metrics files (:mod:`flows.progress.training`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.errors import ChildProcessFailed
from core.files.atomic import read_json
from core.rundir import RunPaths, file_stats
from core.stage import Inputs, Progress, Stage
from trainer.checkpoint.layout import MANIFEST_NAME, export_state_file, list_checkpoints, manifest_file
from trainer.parallel.launch import launch_command, launched_env, launched_fds

Launcher = Callable[[Sequence[str], "TrainStage", Progress], None]
"""``launcher(argv, stage, on_progress)``: runs the trainer's argv to its end; raises when it fails."""

TRAINER_SECTIONS = ("model", "train", "mixture_schedule")
"""The recipe sections the launched trainer reads besides the data (``trainer.train.TrainerSections``)."""

UPSTREAM = ("shard-index", "tokenizer", "base-model")
REFERENCE = "reference"
"""The reference stage (:mod:`trainer.preference.reference_stage`): read by a dpo run that trains on its files."""


def run_child(argv: Sequence[str], stage: TrainStage, on_progress: Progress) -> None:
    """The launcher outside a flow (the Python API, a test): the child's lines go to a plain logger."""
    logger = logging.getLogger("tokenmill.train")
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **launched_env()},
                               pass_fds=launched_fds(stage.paths))
    assert process.stdout is not None
    for line in process.stdout:
        logger.info("%s", line.rstrip())
    if process.wait() != 0:
        raise ChildProcessFailed(f"{argv[0]} … exited with status {process.returncode}")


class TrainStage(Stage):
    """Train to ``until_step`` (``max_steps``, or the newest checkpoint + ``steps_per_refresh`` on a refresh)."""

    name = "train"
    reads = UPSTREAM
    progress_unit = "steps"
    retries = 1
    """A retry resumes from the newest checkpoint (a killed or crashed child); a user error is never retried."""

    def __init__(self, paths: RunPaths, sections: dict[str, Any], until_step: int, num_processes: int = 1,
                 deadline_s: float | None = None, trust_remote_code: bool = False) -> None:
        super().__init__(paths)
        self.sections, self.until_step, self.num_processes = sections, until_step, num_processes
        self.deadline_s, self.trust_remote_code = deadline_s, trust_remote_code
        self.launcher: Launcher = run_child
        self.resolved_config = False
        """Whether the launched trainer reads ``stages/launch.json`` (a flow writes it before launching)."""

    @classmethod
    def build(cls, run: Any, refresh: bool = False) -> TrainStage:
        """``refresh`` (new data arrived): ``train.steps_per_refresh`` more steps from the newest checkpoint."""
        recipe, paths = run.recipe, run.paths
        train = recipe.train
        deadline_s = None if train.deadline_minutes is None else train.deadline_minutes * 60
        sections = recipe.model_dump(mode="json", include=set(TRAINER_SECTIONS))
        stage = cls(paths, sections, target_step(paths, train.max_steps, train.steps_per_refresh, refresh),
                    train.num_processes, deadline_s, run.trust.model_code)
        if train.dpo is not None and train.dpo.stored_reference:
            stage.reads = (*UPSTREAM, REFERENCE)  # waits for the reference log-probs, retrains when they change
        return stage

    def inputs(self, unit: str | None) -> Inputs:
        index = self.paths.shard_index
        return Inputs(settings={**self.sections, "until_step": self.until_step},
                      files={name: digest for name, _, digest in file_stats(self.paths.root, index)},
                      upstream={name: upstream_fingerprint(self.paths, name) for name in self.reads})

    def outputs(self, unit: str | None) -> list[Path]:
        reached = latest_checkpoint_step(self.paths)
        step = reached if reached is not None and reached >= self.until_step else self.until_step
        return [manifest_file(self.paths.checkpoint(step)), export_state_file(self.paths.model)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        argv = launch_command(self.paths.root, self.num_processes, self.until_step,
                              trust_remote_code=self.trust_remote_code, resolved=self.resolved_config)
        self.launcher(argv, self, on_progress)
        return {"step": self.until_step}


def upstream_fingerprint(paths: RunPaths, stage: str) -> str:
    """The fingerprint ``stage``'s marker records, or ``none`` (a stage the recipe leaves out, not run yet); for a
    stage of several units (``stages/<stage>/<unit>.json``), a digest of each unit's."""
    marker = paths.marker(stage)
    folder = marker.with_suffix("")
    if not marker.is_file() and folder.is_dir():
        units = sorted(folder.rglob("*.json"))  # a unit may name a folder: split=train/source=web
        found = {unit.relative_to(folder).as_posix(): upstream_fingerprint_of(unit) for unit in units}
        return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest() if found else "none"
    return upstream_fingerprint_of(marker)


def upstream_fingerprint_of(marker: Path) -> str:
    """The fingerprint the marker file records, or ``none``."""
    try:
        record = read_json(marker) if marker.is_file() else {}
    except (OSError, ValueError):
        record = {}
    found = record.get("fingerprint") if isinstance(record, dict) else None
    return str(found) if found else "none"


def target_step(paths: RunPaths, max_steps: int, steps_per_refresh: int | None, refresh: bool) -> int:
    """``max_steps``; on a refresh, the newest complete checkpoint's step + ``steps_per_refresh``."""
    current = latest_checkpoint_step(paths)
    if refresh and steps_per_refresh is not None and current is not None:
        return current + steps_per_refresh
    return max_steps


def latest_checkpoint_step(paths: RunPaths) -> int | None:
    """Step of the newest complete checkpoint (``checkpoints/step-NNNNNNN`` with its manifest written last)."""
    steps = [step for step, folder in list_checkpoints(paths.checkpoints) if (folder / MANIFEST_NAME).is_file()]
    return max(steps, default=None)
