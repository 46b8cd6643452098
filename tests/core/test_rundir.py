"""core.rundir: the run-dir lock (second process refused, stale lock taken over) and stage markers."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from core.errors import RunLockedError
from core.rundir import RunLock, RunPaths, fingerprint, mark_stage_done, stage_done, stage_summary

HOLD_LOCK = "import sys, time; from core.rundir import RunLock; RunLock(sys.argv[1]).acquire(); " \
            "print('locked', flush=True); time.sleep(600)"


def hold_lock_in_child(run_dir: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "locked"
    return child


def test_second_process_is_refused_with_the_holders_pid_and_host(tmp_path: Path) -> None:
    child = hold_lock_in_child(tmp_path)
    try:
        with pytest.raises(RunLockedError) as refused, RunLock(tmp_path):
            pass
        assert f"pid {child.pid}" in str(refused.value)
        assert socket.gethostname() in str(refused.value)
    finally:
        child.kill()
        child.wait()


def test_a_process_refused_while_the_holder_writes_its_line_still_names_the_holder(tmp_path: Path) -> None:
    # The instant between a holder's flock and its "pid … on host …" line: the lock file is still empty.
    # (CI once refused a second `tokenmill prepare` right then, naming an "unknown process".)
    lock_path = tmp_path / ".lock"
    holder_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    writer = threading.Timer(0.3, os.pwrite, (holder_fd, b"pid 4242 on host elsewhere\n", 0))
    writer.start()
    try:
        with pytest.raises(RunLockedError, match="in use by pid 4242 on host elsewhere"), RunLock(tmp_path):
            pass
    finally:
        writer.join()
        os.close(holder_fd)


def test_lock_of_a_killed_process_is_taken_over(tmp_path: Path) -> None:
    child = hold_lock_in_child(tmp_path)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert (tmp_path / ".lock").read_text().startswith(f"pid {child.pid}")  # the stale file is still there
    with RunLock(tmp_path):
        assert (tmp_path / ".lock").read_text().startswith(f"pid {os.getpid()}")


def test_lock_nests_within_one_process_and_is_released_after(tmp_path: Path) -> None:
    with RunLock(tmp_path), RunLock(tmp_path):  # a flow holding the lock calls a sub-flow that takes it too
        pass
    child = hold_lock_in_child(tmp_path)  # released: another process can take it now
    child.kill()
    child.wait()


def test_stage_markers_record_fingerprint_and_summary(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    first, second = fingerprint("dedupe", {"threshold": 0.8}), fingerprint("dedupe", {"threshold": 0.7})
    assert first != second and first == fingerprint("dedupe", {"threshold": 0.8})
    assert not stage_done(paths, "dedupe", first) and stage_summary(paths, "dedupe") is None
    mark_stage_done(paths, "dedupe", first, {"kept": 3})
    assert stage_done(paths, "dedupe", first) and not stage_done(paths, "dedupe", second)
    assert stage_summary(paths, "dedupe") == {"kept": 3}
