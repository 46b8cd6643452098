"""The run-dir lock: one process writes a run dir; a second one is refused with who holds it."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from pathlib import Path
from typing import ClassVar

from core.errors import RunLockedError
from core.files.atomic import remove_stale_temps, unwritable
from core.files.fence import fence_on, is_ancestor, lift_fence


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


ORPHAN_EXIT_WAIT_S = 10.0
"""How long a lock whose named holder is dead may stay held before a newcomer is refused: the processes that
holder launched (they share its lock) are being killed by the kernel and may take a moment to release it."""


def _wait_for_launched_of_dead_holder(fd: int, holder: str) -> bool:
    """Whether ``fd``'s flock was taken once the processes of a dead holder (named in ``holder``) let go of it.

    The holder, on this host, is gone while its lock is still held: processes it launched share the lock and
    are exiting (their parent-death signal); wait up to ORPHAN_EXIT_WAIT_S for them. False at once for a live
    holder or one on another host.
    """
    match = _HOLDER_LINE.fullmatch(holder)
    if match is None or match.group(2) != socket.gethostname() or _alive(int(match.group(1))):
        return False
    deadline = time.monotonic() + ORPHAN_EXIT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        return True
    return False


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc: alive, as far as we can tell
        return True


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock``; the holder's pid and host are written inside.

    The kernel drops the lock when its holder dies (even by ``kill -9``), so a stale lock file from a
    killed process is simply taken over.

    ``launched_by`` is for a process started by the lock holder to work in the run dir on its behalf (the
    trainer that a flow launches through ``accelerate launch``): when the lock is held by exactly that
    process, and it is an ancestor of this one on this host, the lock is shared instead of refused, and every
    write of this process is fenced on the launcher being alive (:mod:`core.files.fence`). A launcher passes its lock's
    file descriptor (:meth:`held_fd`) to what it launches, so the kernel keeps the lock held until the last of
    them is gone: a re-run never writes beside a launched process that outlived its launcher.
    """

    _held: ClassVar[dict[Path, int]] = {}  # lock path -> nesting depth in this process (flows nest)
    _fds: ClassVar[dict[Path, int]] = {}  # lock path -> the descriptor holding the flock (held here, not shared)

    def __init__(self, lock_file: Path, *, launched_by: int | None = None) -> None:
        """``lock_file``: the run dir's ``.lock`` (take the lock through :meth:`core.rundir.RunPaths.lock`)."""
        self.path = Path(lock_file).resolve()
        self.launched_by = launched_by
        self.shared = False
        """True once acquired through ``launched_by`` (the launcher holds the flock, this process holds none)."""
        self._fd: int | None = None

    def acquire(self) -> None:
        if self.path in RunLock._held:
            RunLock._held[self.path] += 1
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # the first write into a run dir: an unusable --run-dir is one line, here
            raise (unwritable(err, self.path.parent) or err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            if self.launched_by is not None and self._held_by_launcher(holder):
                os.close(fd)
                self.shared = True
                fence_on(self.launched_by)
                RunLock._held[self.path] = 1
                return
            if not _wait_for_launched_of_dead_holder(fd, holder):
                os.close(fd)
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
        RunLock._fds[self.path] = fd
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
        return pid == self.launched_by and host == socket.gethostname() and is_ancestor(pid)

    @staticmethod
    def held_fd(lock_file: Path) -> int | None:
        """The descriptor of ``lock_file``'s flock when this process holds it itself (not shared), else None.

        For a launcher to pass to the process it launches (``subprocess.Popen(pass_fds=…)``): the child then
        shares the lock's open file description, and the kernel frees the lock only once both are gone.
        """
        return RunLock._fds.get(Path(lock_file).resolve())

    def release(self) -> None:
        depth = RunLock._held.get(self.path, 0)
        if depth > 1:
            RunLock._held[self.path] = depth - 1
            return
        RunLock._held.pop(self.path, None)
        RunLock._fds.pop(self.path, None)
        if self.shared and self.launched_by is not None:
            lift_fence(self.launched_by)
        self.shared = False
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
