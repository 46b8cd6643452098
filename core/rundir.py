"""The run directory's writes: atomically, the lock and the stage markers (its paths: core.layout)."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any

from core.errors import ConfigError, RunDirError
from core.files.atomic import (
    atomic_path,
    out_of_space,
    read_json,
    remove_folder,
    remove_stale_temps,
    replace_folder,
    sha256_file,
    unwritable,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from core.files.fence import check_fence
from core.files.path_limits import run_dir_problem
from core.layout import PART_FILES, RunLayout
from core.layout import TASK_FILE_NAME as TASK_FILE_NAME  # re-exported: trainer.config, flows.cli
from core.runlock import RunLock

CODE_VERSION = "0.1.0"
"""Part of every stage fingerprint: bump it when a stage's output for the same input changes."""




@dataclass(frozen=True)
class RunPaths(RunLayout):
    """The run dir ``runs/<name>/``: its layout (:class:`core.layout.RunLayout`, every path) and its writes.

    The only writer into a run: every other module asks it for a path and writes through it (atomically, the
    stage markers, the lock); tests hold both rules with ``ast``. Resolved once where a flow or command starts,
    then passed down. Frozen and made of one path, so a Prefect task can take it as a parameter (hashed) and Dask
    can pickle it. The seam for a run dir on object storage.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if (problem := run_dir_problem(self.root)) is not None:  # before any work: not `File name too long` later
            raise ConfigError(f"{self.root}: cannot be a run dir: {problem}.")

    def check_is_run(self) -> RunPaths:
        """Itself when the folder holds a run's files (:attr:`run_dir_signs`); RunDirError, one line, otherwise.

        The reading commands (query, report, shards, eval, generate) call it first: over a folder that holds no
        run, every view would be empty and a query would answer 0 rows as if that were the run's answer.
        """
        if not self.root.is_dir():
            problem = "is a file, not a folder" if self.root.exists() else "does not exist"
            raise RunDirError(f"{self.root}: {problem}; give the run dir a tokenmill run wrote (runs/<name>).")
        if not any(sign.exists() for sign in self.run_dir_signs) and next(self.docs.glob(PART_FILES), None) is None:
            raise RunDirError(f"{self.root}: not a tokenmill run dir (no run.yaml, stages/, shards/index.parquet, "
                              "docs/part-*.parquet or model/); give the run dir a tokenmill run wrote (runs/<name>), "
                              "or make one: tokenmill prepare RECIPE --run-dir DIR.")
        return self

    # ---- writes: every file of a run is written through these --------------------------------------------

    def atomic_write(self, path: Path, size_hint_bytes: int | None = None) -> AbstractContextManager[Path]:
        """A temporary path beside ``path``, renamed over it when the block succeeds
        (:func:`core.files.atomic.atomic_path`).

        ``size_hint_bytes``: the room the writer expects to need, named in an OutOfSpaceError.
        """
        return atomic_path(self._inside(path), size_hint_bytes)

    def write_bytes(self, path: Path, data: bytes) -> None:
        write_bytes_atomic(self._inside(path), data)

    def write_text(self, path: Path, text: str) -> None:
        write_text_atomic(self._inside(path), text)

    def write_json(self, path: Path, obj: Any) -> None:
        """``obj`` as pretty, key-sorted JSON (deterministic bytes), written atomically."""
        write_json_atomic(self._inside(path), obj)

    def append_text(self, path: Path, text: str) -> None:
        """Append ``text`` and flush (a log row: a killed writer leaves at most a torn last line, not a lost file).

        A write that fails for lack of room raises OutOfSpaceError naming ``path``; a folder that cannot be written,
        UnwritableError.
        """
        target = self._inside(path)
        check_fence()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
        except OSError as err:
            if (user_error := out_of_space(err, target, len(text.encode("utf-8"))) or unwritable(err, target.parent)):
                raise user_error from err
            raise

    def replace_folder(self, source: Path, target: Path) -> None:
        """Rename the complete folder ``source`` over ``target`` (a checkpoint, an export), both in the run dir."""
        replace_folder(self._inside(source), self._inside(target))

    def remove_folder(self, folder: Path) -> None:
        """Delete a run-dir folder and its contents (an old checkpoint pruned)."""
        remove_folder(self._inside(folder))

    def remove_stale_temps(self, folder: Path) -> int:
        """Delete what writers killed mid-write left in ``folder`` (a run-dir folder); return how many."""
        return remove_stale_temps(self._inside(folder))

    def lock(self, *, launched_by: int | None = None) -> RunLock:
        """The run-dir lock (a context manager): a second process writing this run dir is refused."""
        return RunLock(self.lock_file, launched_by=launched_by)

    def held_lock_fd(self) -> int | None:
        """The descriptor of this run dir's lock when this process holds it itself (see RunLock.held_fd)."""
        return RunLock.held_fd(self.lock_file)

    def _inside(self, path: Path) -> Path:
        """``path`` itself; ValueError when it does not lie in this run dir (a writer was handed a foreign path)."""
        if not Path(path).is_relative_to(self.root):
            raise ValueError(f"{path}: not inside the run dir {self.root}; only run-dir files are written "
                             "through RunPaths (ask it for the path).")
        return Path(path)

    # ---- skip-if-done markers: written and read by core.stage.run_stage -------------------------------------
    #
    # A stage (or one unit of it: an ingest part, a pack (split, source)) is done when its marker holds the
    # fingerprint of its inputs (core.stage.Inputs). Markers live only under ``stages/``: ``stages/<stage>.json``
    # for a whole-run stage, ``stages/<stage>/<unit>.json`` for a unit, written atomically, last, after every
    # output is in place. Incremental *state* a stage needs (dedupe's seen parts, pack's packed parts) stays
    # with the stage's outputs. A run dir written before markers recorded their inputs is refused in one line
    # (core.stage.read_marker), not migrated.

    def marker(self, stage: str, unit: str | None = None) -> Path:
        """``stages/<stage>.json``, or ``stages/<stage>/<unit>.json`` for one unit of the stage."""
        return self.stage_marker(stage, unit)

    def finished_marker(self, stage: str, unit: str | None = None) -> Path | None:
        """The marker recording that (stage, unit) finished, with any fingerprint; None when it has not."""
        marker = self.marker(stage, unit)
        return marker if marker.is_file() else None

    def done_summary(self, stage: str, stage_fingerprint: str, unit: str | None = None) -> dict[str, Any] | None:
        """The recorded summary when (stage, unit) finished with exactly this fingerprint, else None."""
        marker = self.marker(stage, unit)
        if marker.is_file() and (record := read_json(marker)).get("fingerprint") == stage_fingerprint:
            return record["summary"]
        return None

    def mark_done(self, stage: str, stage_fingerprint: str, summary: dict[str, Any], unit: str | None = None,
                  **record: Any) -> None:
        """Record that (stage, unit) finished; call it last, after every output of the stage is in place.

        For the steps not yet a :class:`core.stage.Stage` (training, the evaluation's record); a stage's
        marker is written by :func:`core.stage.run_stage`. ``record`` adds fields to the marker.
        """
        self.write_json(self.marker(stage, unit), {"fingerprint": stage_fingerprint, "summary": summary, **record})

    def clear_done(self, stage: str, unit: str | None = None) -> None:
        """Forget that (stage, unit) finished (before its outputs are rewritten)."""
        self.marker(stage, unit).unlink(missing_ok=True)


def path_inside_run(run_dir: Path, path: Path) -> bool:
    """Whether ``path``, every symlink followed, lies inside the run dir (a symlink loop counts as outside)."""
    try:
        return path.resolve().is_relative_to(Path(run_dir).resolve())
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return False


def fingerprint(*parts: Any) -> str:
    """Deterministic sha256 over JSON-serialisable parts (settings, input digests, code version)."""
    payload = json.dumps([CODE_VERSION, *parts], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


SMALL_FILE_BYTES = 1 << 20
"""Files up to this size are identified by their sha256 in :func:`file_stats`, larger ones by their stat."""


def file_stats(root: Path, top: Path, skipped: frozenset[Path] = frozenset(),
               *, hash_small: bool = True) -> list[tuple[str, int, str]]:
    """``(path relative to root, size, identity)`` of every file under ``top`` (a file or a folder), sorted.

    For skip-if-unchanged checks over outputs too large to hash each time (checkpoints, shards): a file up to
    SMALL_FILE_BYTES is identified by its sha256 (a recipe or an index rewritten with the same bytes is
    unchanged), a larger one by its mtime and inode (an atomic rewrite is a new inode, so it shows even within
    the file system's timestamp granularity). Paths in ``skipped`` (files or folders) are left out; symlinks
    are not followed (a hostile run dir may loop); a missing ``top`` gives no entries. ``hash_small=False``
    identifies every file by its stat (any rewrite counts as a change).
    """
    if top.is_symlink() or not top.is_dir():
        exists = top.is_file() or top.is_symlink()
        return [_file_stat(root, top, hash_small)] if exists and top not in skipped else []
    entries = []
    for folder, subfolders, files in os.walk(top):  # a link to a folder is listed among subfolders, not entered
        links = [name for name in subfolders if Path(folder, name).is_symlink()]
        subfolders[:] = sorted(name for name in subfolders if Path(folder, name) not in skipped and name not in links)
        entries.extend(_file_stat(root, Path(folder, name), hash_small) for name in sorted([*files, *links])
                       if Path(folder, name) not in skipped)
    return entries


def _file_stat(root: Path, path: Path, hash_small: bool) -> tuple[str, int, str]:
    stat = path.lstat()
    if path.is_symlink():
        return path.relative_to(root).as_posix(), stat.st_size, f"link:{os.readlink(path)}"
    small = hash_small and stat.st_size <= SMALL_FILE_BYTES and S_ISREG(stat.st_mode)  # never open a FIFO or a device
    identity = sha256_file(path) if small else f"{stat.st_mtime_ns}:{stat.st_ino}"
    return path.relative_to(root).as_posix(), stat.st_size, identity
