"""A process working under the run-dir lock its launcher lends it writes nothing once the launcher is gone, and the
run dir stays locked until that process is gone too (core.files.fence, core.runlock)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from core.rundir import RunPaths

REPO_ROOT = Path(__file__).resolve().parents[2]
LIVENESS_S = 30
"""A bound on how long a process that must go may take: a liveness check, not a speed claim."""
LAUNCHER = """
import os, subprocess, sys
from core.rundir import RunPaths
from trainer.parallel.launch import launched_env, launched_fds
paths = RunPaths(sys.argv[1])
with paths.lock():  # what a flow does around `accelerate launch`: the same environment, the same descriptors
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[1:]], env={**os.environ, **launched_env()},
                             pass_fds=launched_fds(paths))
    print(child.pid, flush=True)
    child.wait()
"""
WORKER = """
import os, sys, time
from pathlib import Path
from core.rundir import RunPaths
paths, write, gate = RunPaths(sys.argv[1]), sys.argv[3], Path(sys.argv[4])
staged = paths.checkpoints / ".tmp-step-0000002"
staged.mkdir(parents=True)
with paths.lock(launched_by=int(os.environ["TOKENMILL_PARENT_PID"])) as lock:
    print("shared" if lock.shared else "held", flush=True)
    while gate.exists():  # a trainer about to publish
        time.sleep(0.01)
    if write == "write_json":
        paths.write_json(paths.checkpoints / "latest", {"step": 2})
    elif write == "append_text":
        paths.append_text(paths.metrics / "train.jsonl", "{}\\n")
    else:
        paths.replace_folder(staged, paths.checkpoints / "step-0000002")
    print("wrote", flush=True)
"""
WRITTEN = {"write_json": "checkpoints/latest", "append_text": "metrics/train.jsonl",
           "replace_folder": "checkpoints/step-0000002"}


def lock_is_free(run_dir: Path) -> bool:
    """Whether a newcomer's non-blocking flock on the run dir's lock would succeed (released again at once)."""
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


@pytest.mark.parametrize("write", sorted(WRITTEN))
def test_a_launched_process_writes_nothing_once_its_launcher_is_killed(tmp_path: Path, write: str) -> None:
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.touch()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir), WORKER, write, str(gate)],
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert launcher.stdout is not None
    worker = psutil.Process(int(launcher.stdout.readline()))
    try:
        assert launcher.stdout.readline().strip() == "shared"
        launcher.send_signal(signal.SIGKILL)  # the `tokenmill train` that launched it: kill -9
        assert launcher.wait(timeout=LIVENESS_S) == -signal.SIGKILL
        # The worker outlived its launcher (it has no parent-death signal here): the run dir stays locked for it.
        assert worker.is_running() and not lock_is_free(run_dir)
        gate.unlink()  # now it would publish
        output = launcher.stdout.read()  # until the worker, the last writer of the pipe, is gone
        psutil.wait_procs([worker], timeout=LIVENESS_S)
    finally:
        if worker.is_running():
            worker.kill()
    assert not (run_dir / WRITTEN[write]).exists(), output
    assert "wrote" not in output
    assert f"error: pid {launcher.pid}, which launched this process and holds the run dir's lock, is gone" in output
    assert lock_is_free(run_dir)


def test_a_newcomer_waits_for_the_launched_processes_of_a_dead_holder(tmp_path: Path) -> None:
    """The lock file names a holder that is gone while the lock is still held (by what it launched, exiting):
    the newcomer waits for it instead of being refused."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / ".lock").write_text(f"pid {dead.pid} on host {socket.gethostname()}\n")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
                               "time.sleep(1.0)", str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with RunPaths(run_dir).lock():  # not refused naming a process that is gone
            assert (run_dir / ".lock").read_text().startswith(f"pid {os.getpid()} on host ")
        assert holder.wait(timeout=LIVENESS_S) == 0
    finally:
        holder.kill()
        holder.wait()
