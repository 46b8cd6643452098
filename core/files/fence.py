"""The write fence: a process working under a run-dir lock its launcher holds writes only while that launcher lives.

A trainer launched by a ``tokenmill`` command shares the command's lock (:class:`core.runlock.RunLock`,
``launched_by``). Should the command die (``kill -9``, the OOM killer), a re-run may take the lock over, and a
trainer still alive must not write one byte more. The kernel kills it at once (``PR_SET_PDEATHSIG``, see
:func:`trainer.parallel.launch.exit_with_parent`) and keeps the lock held until it is gone (it inherits the lock's file
description); this fence is the check at the moment of each write, whatever else failed: every writer of
:mod:`core.files.atomic` and :class:`core.rundir.RunPaths` (a file's rename into place, an appended log row, a folder's
rename, a removal) calls :func:`check_fence` first.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

FENCE_EXIT_STATUS = 137
"""What a fenced process exits with: the status of a ``kill -9``, which is what it stands for."""

_launchers: dict[int, int] = {}
"""Launcher pid -> how many locks of this process it lends (fenced while at least one)."""


def is_ancestor(pid: int) -> bool:
    """True when ``pid`` is this process's parent, grandparent, … (read from ``/proc``; the parent only without it).

    A dead ancestor is no ancestor any more: its children were handed to init (or a subreaper), and a pid
    recycled since then is not on this process's chain either.
    """
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


def fence_on(launcher_pid: int) -> None:
    """From now on, every run-dir write of this process requires ``launcher_pid`` to be alive as its ancestor."""
    _launchers[launcher_pid] = _launchers.get(launcher_pid, 0) + 1


def lift_fence(launcher_pid: int) -> None:
    """Undo one :func:`fence_on` (the lock it lent is released)."""
    count = _launchers.pop(launcher_pid, 0) - 1
    if count > 0:
        _launchers[launcher_pid] = count


def check_fence() -> None:
    """Before a write into a run dir: return when every launcher this process works for is alive, else exit now.

    It exits (status 137, one line on stderr) rather than raising: an exception would run ``finally`` blocks
    and error handlers that write too (a staging folder removed, trackers flushed), and nobody is left to
    report to. One read of ``/proc`` per process between this one and the launcher: 75 µs a call measured for a
    launcher that is the parent, on a busy 2-core machine (a metrics row or a checkpoint, not a training step).
    """
    for pid in list(_launchers):
        if not is_ancestor(pid):
            with contextlib.suppress(OSError):
                os.write(2, f"error: pid {pid}, which launched this process and holds the run dir's lock, is "
                            "gone; stopping before the next write into the run dir.\n".encode())
            os._exit(FENCE_EXIT_STATUS)
