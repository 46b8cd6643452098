"""The checkpoint folders' names, readable without torch: the flows list them before launching a trainer."""

from __future__ import annotations

import re
from pathlib import Path

from core.atomic import read_json
from core.errors import ConfigError
from core.rundir import RunPaths

MANIFEST_NAME = "manifest.json"
"""Written last into a checkpoint folder: a folder without it is incomplete."""
EXPORT_STATE_NAME = "training_state.json"
"""Written last into a Hugging Face export (``model/``): its step and tokens seen (:mod:`trainer.export`)."""
STEP_DIR_PATTERN = re.compile(r"^step-(\d{7})$")


def step_dir_name(step: int) -> str:
    """``step-NNNNNNN`` (7 digits, so names sort by step)."""
    return f"step-{step:07d}"


def list_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step-NNNNNNN`` folder, oldest first; validity is not checked."""
    if not checkpoints_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoints_dir.iterdir()
             if p.is_dir() and (m := STEP_DIR_PATTERN.match(p.name))]
    return sorted(found)


def chosen_checkpoints(paths: RunPaths, which: str | int) -> list[tuple[int, Path]]:
    """``last`` (the newest), ``all`` (every kept one, oldest first) or one step; CheckpointError-free.

    Raises ConfigError when there is no checkpoint, or the step asked for is not kept.
    """
    found = list_checkpoints(paths.checkpoints)
    if not found:
        raise ConfigError(f"{paths.checkpoints}: no checkpoint to evaluate; train first (`tokenmill train`).")
    if which == "all":
        return found
    if which == "last":
        return found[-1:]
    chosen = [(step, folder) for step, folder in found if step == int(which)]
    if not chosen:
        raise ConfigError(f"--checkpoint {which}: no such checkpoint in {paths.checkpoints} (kept: "
                          f"{', '.join(str(step) for step, _ in found)}); name one of those, `last` or `all`.")
    return chosen


def exported_step(model_dir: Path) -> int | None:
    """The training step of an existing export, or None when there is no complete export."""
    marker = Path(model_dir) / EXPORT_STATE_NAME
    if not (marker.is_file() and (Path(model_dir) / "model.safetensors").is_file()):
        return None
    return read_json(marker).get("step")
