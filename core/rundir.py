"""The run directory: where every stage writes, the lock that keeps a second process out, stage markers."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from core.atomic import read_json, remove_stale_temps, write_json_atomic
from core.errors import RunLockedError

CODE_VERSION = "0.1.0"
"""Part of every stage fingerprint: bump it when a stage's output for the same input changes."""


@dataclass(frozen=True)
class RunPaths:
    """The documented layout of ``runs/<name>/`` (see ARCHITECTURE.md, "The run directory").

    The only place that names a run's files: every other module asks it (a test greps for hand-built paths).
    Frozen and made of one path, so a Prefect task can take it as a parameter.
    """

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str from the CLI or a flow parameter

    @property
    def recipe(self) -> Path:
        return self.root / "run.yaml"

    @property
    def lock(self) -> Path:
        """``.lock``: see :class:`RunLock`."""
        return self.root / ".lock"

    @property
    def docs(self) -> Path:
        return self.root / "docs"

    @property
    def ingest_plan(self) -> Path:
        """``docs/plan.json``: which source files go in which ingest part (ingest's stage state)."""
        return self.docs / "plan.json"

    @property
    def rejects(self) -> Path:
        return self.root / "rejects"

    @property
    def dedupe(self) -> Path:
        return self.root / "dedupe"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer" / "tokenizer.json"

    @property
    def special_tokens(self) -> Path:
        """``tokenizer/special_tokens.json``: eos/pad/bos ids of a model's own tokenizer (see tokenization)."""
        return self.root / "tokenizer" / "special_tokens.json"

    @property
    def base_model(self) -> Path:
        """``base_model/``: the Hugging Face config (and weights, for continued pretraining) the run starts from,
        hard-linked or copied in by the model stage, so the run dir needs nothing outside itself."""
        return self.root / "base_model"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def shard_index(self) -> Path:
        return self.root / "shards" / "index.parquet"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def tensorboard(self) -> Path:
        return self.metrics / "tensorboard"

    @property
    def profile(self) -> Path:
        """``metrics/profile/``: the torch profiler's traces (``train.profile_steps``)."""
        return self.metrics / "profile"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def stages(self) -> Path:
        """Stage completion markers (``<stage>.json``, ``<stage>/<unit>.json``): see :func:`done_summary`."""
        return self.root / "stages"


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


# ---- skip-if-done: the one completion mechanism of every stage ------------------------------------------
#
# A stage (or one unit of it: an ingest part, a pack (split, source)) is done when its marker holds the
# fingerprint of its inputs + settings + CODE_VERSION. Markers live only under ``stages/``:
# ``stages/<stage>.json`` for a whole-run stage, ``stages/<stage>/<unit>.json`` for a unit. Each holds
# ``{"fingerprint", "summary", ...}`` and is written atomically, last, after every output is in place.
# Incremental *state* a stage needs (dedupe's seen parts, pack's packed parts) stays with the stage's
# outputs; whether the work is done is answered only here.

MARKER_KEYS = ("fingerprint", "part", "summary")
"""The keys a marker keeps when it is migrated from a run dir written before ``stages/`` held every marker."""


def stage_marker(paths: RunPaths, stage: str, unit: str | None = None) -> Path:
    """``stages/<stage>.json``, or ``stages/<stage>/<unit>.json`` for one unit of the stage."""
    return paths.stages / f"{stage}.json" if unit is None else paths.stages / stage / f"{unit}.json"


def legacy_marker(paths: RunPaths, stage: str, unit: str | None = None) -> Path | None:
    """Where tokenmill 0.1.0 run dirs of before ``stages/`` kept this stage's fingerprint (None: nowhere else).

    Read only when the marker under ``stages/`` is missing or does not match, then migrated (see
    :func:`done_summary`), so run dirs written by that version keep their finished work.
    """
    legacy = {"ingest": paths.docs / f"{unit}.json", "dedupe": paths.dedupe / "state.json",
              "decontaminate": paths.dedupe / "decontaminate.json", "tokenizer": paths.tokenizer.parent / "meta.json"}
    return legacy.get(stage) if (stage != "ingest" or unit is not None) else None


def finished_marker(paths: RunPaths, stage: str, unit: str | None = None) -> Path | None:
    """The marker recording that (stage, unit) finished, with any fingerprint; None when it has not.

    A legacy ingest part marker counts by its presence alone (as it did); the other legacy files also hold
    stage state, so they count only while they still carry a fingerprint.
    """
    marker = stage_marker(paths, stage, unit)
    if marker.is_file():
        return marker
    legacy = legacy_marker(paths, stage, unit)
    if legacy is None or not legacy.is_file():
        return None
    return legacy if stage == "ingest" or "fingerprint" in read_json(legacy) else None


def done_summary(paths: RunPaths, stage: str, stage_fingerprint: str, unit: str | None = None) -> dict[str, Any] | None:
    """The recorded summary when (stage, unit) finished with exactly this fingerprint, else None.

    A matching legacy marker is migrated: copied under ``stages/`` and its fingerprint dropped from the old place.
    """
    marker = stage_marker(paths, stage, unit)
    if marker.is_file() and (record := read_json(marker)).get("fingerprint") == stage_fingerprint:
        return record["summary"]
    legacy = legacy_marker(paths, stage, unit)
    if legacy is None or not legacy.is_file():
        return None
    record = read_json(legacy)
    if record.get("fingerprint") != stage_fingerprint or "summary" not in record:
        return None
    write_json_atomic(marker, {key: record[key] for key in MARKER_KEYS if key in record})
    _drop_legacy(legacy, record)
    return record["summary"]


def migrate_legacy_marker(paths: RunPaths, stage: str, unit: str | None = None) -> None:
    """Move a legacy marker of (stage, unit) under ``stages/`` as it is (a no-op when there is none to move)."""
    legacy = legacy_marker(paths, stage, unit)
    marker = stage_marker(paths, stage, unit)
    if legacy is None or marker.is_file() or not legacy.is_file():
        return
    record = read_json(legacy)
    if "fingerprint" in record:
        write_json_atomic(marker, {key: record[key] for key in MARKER_KEYS if key in record})
        _drop_legacy(legacy, record)


def stage_done(paths: RunPaths, stage: str, stage_fingerprint: str, unit: str | None = None) -> bool:
    """True when (stage, unit) completed with exactly this fingerprint (its outputs can be reused)."""
    return done_summary(paths, stage, stage_fingerprint, unit) is not None


def mark_stage_done(paths: RunPaths, stage: str, stage_fingerprint: str, summary: dict[str, Any],
                    unit: str | None = None, **record: Any) -> None:
    """Record that (stage, unit) finished; call it last, after every output of the stage is in place.

    ``record`` adds fields to the marker (an ingest part's ``part``). A legacy marker of the unit is dropped, so
    it can never vouch for outputs made with other settings.
    """
    write_json_atomic(stage_marker(paths, stage, unit),
                      {"fingerprint": stage_fingerprint, "summary": summary, **record})
    legacy = legacy_marker(paths, stage, unit)
    if legacy is not None and legacy.is_file():
        _drop_legacy(legacy, read_json(legacy))


def clear_stage_done(paths: RunPaths, stage: str, unit: str | None = None) -> None:
    """Forget that (stage, unit) finished (before its outputs are rewritten), under ``stages/`` and legacy."""
    stage_marker(paths, stage, unit).unlink(missing_ok=True)
    legacy = legacy_marker(paths, stage, unit)
    if legacy is not None and legacy.is_file():
        _drop_legacy(legacy, read_json(legacy))


def stage_summary(paths: RunPaths, stage: str, unit: str | None = None) -> dict[str, Any] | None:
    """The summary a finished (stage, unit) recorded, whatever its fingerprint, or None when it has not finished."""
    marker = finished_marker(paths, stage, unit)
    return read_json(marker).get("summary") if marker is not None else None


def _drop_legacy(legacy: Path, record: dict[str, Any]) -> None:
    """Remove a legacy marker; one that also holds stage state (dedupe's parts) keeps the state, minus the marker."""
    state = {key: value for key, value in record.items() if key not in MARKER_KEYS}
    if state:
        write_json_atomic(legacy, state)
    else:
        legacy.unlink()


def _read_holder(fd: int, patience_s: float = 2.0) -> str:
    """The lock holder's "pid … on host …" line.

    A holder writes it just after taking the lock, so a process refused in that instant can find the file
    still empty; it waits briefly for the line rather than naming an "unknown process".
    """
    deadline = time.monotonic() + patience_s
    while True:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        if holder or time.monotonic() >= deadline:
            return holder or "unknown process"
        time.sleep(0.02)


_HOLDER_LINE = re.compile(r"pid (\d+) on host (\S+)")
"""What a lock holder writes into ``<run_dir>/.lock`` (see :meth:`RunLock.acquire`)."""


def _is_ancestor(pid: int) -> bool:
    """True when ``pid`` is this process's parent, grandparent, … (read from ``/proc``; the parent only without it)."""
    if not Path("/proc/self/stat").is_file():
        return os.getppid() == pid
    current = os.getpid()
    while current > 1:
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
        except OSError:
            return False
        current = int(stat.rsplit(")", 1)[1].split()[1])  # the field after "(comm) state"; comm may hold spaces
        if current == pid:
            return True
    return False


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``; the holder's pid and host are written inside.

    The kernel drops the lock when its holder dies (even by ``kill -9``), so a stale lock file from a
    killed process is simply taken over.

    ``launched_by`` is for a process started by the lock holder to work in the run dir on its behalf (the
    trainer that a flow launches through ``accelerate launch``): when the lock is held by exactly that
    process, and it is an ancestor of this one on this host, the lock is shared instead of refused. The
    launched process must not outlive its launcher (the trainer's TOKENMILL_PARENT_PID watchdog), since
    the lock goes when the launcher goes.
    """

    _held: ClassVar[dict[Path, int]] = {}  # lock path -> nesting depth in this process (flows nest)

    def __init__(self, run_dir: str | Path, *, launched_by: int | None = None) -> None:
        self.path = (Path(run_dir) / ".lock").resolve()
        self.launched_by = launched_by
        self.shared = False
        """True once acquired through ``launched_by`` (the launcher holds the flock, this process holds none)."""
        self._fd: int | None = None

    def acquire(self) -> None:
        if self.path in RunLock._held:
            RunLock._held[self.path] += 1
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            if self._held_by_launcher(holder):
                self.shared = True
                RunLock._held[self.path] = 1
                return
            raise RunLockedError(
                f"{self.path.parent}: run directory is in use by {holder}; wait for it to finish "
                "or use another --run-dir."
            ) from None
        # Overwrite, then trim: a waiting process never reads an empty file left between truncate and write.
        holder = f"pid {os.getpid()} on host {socket.gethostname()}\n".encode()
        os.pwrite(fd, holder, 0)
        os.ftruncate(fd, len(holder))
        self._fd = fd
        RunLock._held[self.path] = 1
        # The holder is the run dir's only writer, so a temporary file in it was left by a writer killed
        # mid-write (kill -9, OOM, power loss): remove it, so no half-written file outlives the next run.
        remove_stale_temps(self.path.parent)

    def _held_by_launcher(self, holder: str) -> bool:
        """Whether ``holder`` (the lock file's line) names ``launched_by``, alive as an ancestor on this host.

        The ancestry check keeps a stale or copied TOKENMILL_PARENT_PID from opening a run dir that some
        other process holds: only the process that (indirectly) started this one can lend it its lock.
        """
        match = _HOLDER_LINE.fullmatch(holder)
        if self.launched_by is None or match is None:
            return False
        pid, host = int(match.group(1)), match.group(2)
        return pid == self.launched_by and host == socket.gethostname() and _is_ancestor(pid)

    def release(self) -> None:
        depth = RunLock._held.get(self.path, 0)
        if depth > 1:
            RunLock._held[self.path] = depth - 1
            return
        RunLock._held.pop(self.path, None)
        self.shared = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
