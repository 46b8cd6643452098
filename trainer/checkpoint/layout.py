"""The checkpoint folders' names, readable without torch: the flows list them before launching a trainer."""

from __future__ import annotations

from pathlib import Path

from core.errors import ConfigError
from core.files.atomic import read_json
from core.layout import CHECKPOINT_MANIFEST, STEP_DIR_PATTERN
from core.layout import step_dir_name as step_dir_name
from core.rundir import RunPaths

MANIFEST_NAME = CHECKPOINT_MANIFEST
"""Written last into a checkpoint folder: a folder without it is incomplete."""
EXPORT_STATE_NAME = "training_state.json"
"""Written last into a Hugging Face export (``model/``): its step and tokens seen (:mod:`trainer.model.export`)."""


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


def manifest_file(checkpoint: Path) -> Path:
    """A checkpoint folder's ``manifest.json`` (written last: without it the checkpoint is incomplete)."""
    return Path(checkpoint) / MANIFEST_NAME


def export_state_file(model_dir: Path) -> Path:
    """An export's ``training_state.json`` (written last): its step and tokens seen."""
    return Path(model_dir) / EXPORT_STATE_NAME


def exported_step(model_dir: Path) -> int | None:
    """The training step of an existing export, or None when there is no complete export."""
    marker = export_state_file(model_dir)
    if not (marker.is_file() and (Path(model_dir) / "model.safetensors").is_file()):
        return None
    return read_json(marker).get("step")
