"""The checkpoint folders' names, readable without torch: the flows list them before launching a trainer."""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST_NAME = "manifest.json"
"""Written last into a checkpoint folder: a folder without it is incomplete."""
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
