"""What the file system allows a name and a path, checked where names and run dirs enter, before any work.

A recipe's ``name`` becomes the run dir ``runs/<name>``, a source's name the shard folder ``source=<name>`` and
the pack marker ``stages/pack/split=<split>/source=<name>.json``, each written under a temporary name
``.tmp-<file name>.XXXXXXXX`` first (:func:`core.files.atomic.atomic_path`). A name too long for that fails only when
the stage that makes the file runs (ingest, dedupe and the tokenizer done, then ``File name too long``), so the
names are checked when the recipe and manifests are read, and the run dir when :class:`core.rundir.RunPaths`
is made: one line naming the value and the limit.
"""

from __future__ import annotations

import os
from pathlib import Path

from core.layout import MIRROR_STATE_SUFFIX

NAME_MAX_BYTES = 255
"""Bytes in one path component on Linux's and macOS's file systems (NAME_MAX), when the file system cannot say."""
PATH_MAX_BYTES = 4096
"""Bytes in a whole path, its final NUL included (Linux's PATH_MAX), when the file system cannot say."""
LONGEST_NAME_WRAPPING = ".tmp-source=.json.XXXXXXXX"
"""The most tokenmill adds around a source name in one file name: the pack marker ``source=<name>.json`` while
it is written (``.tmp-`` + name + ``.`` + mkstemp's 8 random characters)."""
MAX_NAME_BYTES = NAME_MAX_BYTES - len(LONGEST_NAME_WRAPPING)
"""The longest recipe, corpus or source name: 229 bytes (names are ASCII: the name patterns allow no other)."""
LONGEST_RUN_DIR_SUFFIX = MIRROR_STATE_SUFFIX
"""What is kept beside a run dir's local copy of a bucket (``<copy>.mirror.json``, :mod:`pipeline.sql.run_mirror`)."""
LAYOUT_DEPTH_BYTES = 1024
"""Room kept below the run dir for its deepest path: a shard's temporary name under
``shards/split=<split>/source=<name>/`` (~290 bytes with the longest name), checkpoint staging folders and the
trackers' own folders (``metrics/mlflow/…``, ``metrics/wandb/…``) with margin."""


def name_problem(name: str) -> str | None:
    """Why ``name`` (a recipe, corpus or source name) cannot be used as a file name, or None when it can."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size <= MAX_NAME_BYTES:
        return None
    wrapped = LONGEST_NAME_WRAPPING.replace("=", "=<name>")
    return (f"{_shortened(name)!r} is {size} characters, above the {MAX_NAME_BYTES} a name may have (a name is "
            f"part of file names, e.g. {wrapped} while the pack marker is written, and a file system allows "
            f"{NAME_MAX_BYTES} bytes per file name); use a shorter name")


def checked_name(name: str) -> str:
    """``name`` when :func:`name_problem` finds none; ValueError (a pydantic validator's message) otherwise."""
    if (problem := name_problem(name)) is not None:
        raise ValueError(problem)
    return name


def run_dir_problem(run_dir: Path) -> str | None:
    """Why the run dir ``run_dir`` cannot hold a run's files (a folder name or the path too long), or None.

    Uses the limits of the file system the run dir is (or will be) on (``pathconf`` of its nearest existing
    folder), else NAME_MAX_BYTES and PATH_MAX_BYTES.
    """
    absolute = Path(os.path.abspath(run_dir))
    name_max, path_max = _limits(absolute)
    for component in absolute.parts[1:]:
        size = len(os.fsencode(component))
        if size > name_max - (len(LONGEST_RUN_DIR_SUFFIX) if component == absolute.name else 0):
            return (f"the folder name {_shortened(component)!r} is {size} bytes; a file system allows {name_max} "
                    f"per name ({name_max - len(LONGEST_RUN_DIR_SUFFIX)} for the run dir's own, which gets "
                    f"'{LONGEST_RUN_DIR_SUFFIX}' added beside a bucket's copy); use a shorter run dir (--run-dir)")
    size = len(os.fsencode(str(absolute)))
    if size > path_max - 1 - LAYOUT_DEPTH_BYTES:
        return (f"the path is {size} bytes; a file system allows {path_max - 1} per path and the run dir's own "
                f"files need {LAYOUT_DEPTH_BYTES} below it, so at most {path_max - 1 - LAYOUT_DEPTH_BYTES}; use a "
                "shorter run dir (--run-dir)")
    return None


def _limits(path: Path) -> tuple[int, int]:
    """``(NAME_MAX, PATH_MAX)`` of the file system holding ``path`` (or its nearest existing folder)."""
    existing = next((folder for folder in (path, *path.parents) if _is_dir(folder)), None)
    if existing is None:
        return NAME_MAX_BYTES, PATH_MAX_BYTES
    try:
        return os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        return NAME_MAX_BYTES, PATH_MAX_BYTES


def _is_dir(folder: Path) -> bool:
    try:
        return folder.is_dir()
    except OSError:  # ENAMETOOLONG on the too-long folder itself
        return False


def _shortened(name: str) -> str:
    return name if len(name) <= 40 else f"{name[:20]}…{name[-12:]}"
