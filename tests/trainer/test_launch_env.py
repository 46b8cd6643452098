"""The environment a flow launches the trainer with: tokenmill's own `trainer` package, whatever the cwd; and a
trainer whose launcher is killed (kill -9) writes nothing more and holds the run dir until it is gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from core.files.atomic import TEMP_PREFIX
from core.rundir import RunPaths
from tests.trainer.conftest import MakeRunDir
from trainer.checkpoint.writer import PUBLISH_GATE_ENV
from trainer.parallel.launch import PARENT_PID_ENV, launched_env, launched_fds

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_trainer_package_in_the_working_folder_is_not_imported_by_the_launched_module(tmp_path: Path) -> None:
    decoy = tmp_path / "trainer"
    decoy.mkdir()
    (decoy / "__init__.py").write_text('raise SystemExit("decoy: the working folder\'s trainer package")\n')
    argv = [sys.executable, "-m", "trainer.checkpoint.layout"]  # what `accelerate launch -m trainer.train` runs
    plain = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ), check=False)
    assert plain.returncode == 1 and "decoy: the working folder's trainer" in plain.stderr  # the hazard is real
    launched = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=False,
                              env={**os.environ, **launched_env()})
    assert launched.returncode == 0, launched.stderr
    assert launched_env()[PARENT_PID_ENV] == str(os.getpid())


LAUNCHER = """
import logging, sys
from core.rundir import RunPaths
from flows.runtime.subprocess_log import run_streaming
from trainer.parallel.launch import launch_command, launched_env, launched_fds
paths = RunPaths(sys.argv[1])
with paths.lock():  # what the flow's train task does, minus Prefect
    run_streaming(launch_command(paths.root, 1), logging.getLogger("launcher"), deadline_s=None, env=launched_env(),
                  pass_fds=launched_fds(paths))
"""
LIVENESS_S = 60
"""A bound on how long a process that must go may take: a liveness check, not a speed claim."""


@pytest.mark.slow
def test_kill_9_of_the_launcher_as_a_checkpoint_is_published_lands_no_write(make_run_dir: MakeRunDir,
                                                                            tmp_path: Path) -> None:
    """The trainer waits, its step-2 checkpoint complete, just before the rename (PUBLISH_GATE_ENV); its launcher is
    killed then and the gate opened: the trainer publishes nothing, and the run dir is free only once it is gone."""
    run_dir = make_run_dir(train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 4})
    gate = tmp_path / "gate"
    gate.touch()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run_dir)], cwd=REPO_ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, PUBLISH_GATE_ENV: str(gate)})
    staged = run_dir / "checkpoints" / f"{TEMP_PREFIX}step-0000002" / "manifest.json"
    deadline = time.monotonic() + 240
    while not staged.is_file():
        assert launcher.poll() is None and time.monotonic() < deadline, "the step-2 checkpoint was never staged"
        time.sleep(0.02)
    trainers = psutil.Process(launcher.pid).children(recursive=True)
    try:
        assert trainers, "the trainer runs"
        launcher.kill()
        assert launcher.wait(timeout=LIVENESS_S) == -signal.SIGKILL
        gate.unlink()  # were the trainer alive, it would publish now
        with RunPaths(run_dir).lock():  # a re-run gets the run dir only once the trainer is gone
            assert [process for process in trainers if process.is_running()
                    and process.status() != psutil.STATUS_ZOMBIE] == []
        published = [path.name for path in (run_dir / "checkpoints").iterdir() if not path.name.startswith(TEMP_PREFIX)]
        assert published == [], "no checkpoint renamed into place, no latest pointer, nothing pruned"
        assert not (run_dir / "model").exists()
    finally:
        for process in trainers:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_the_lock_a_launched_process_inherits_goes_no_further(tmp_path: Path) -> None:
    """A process the trainer starts with exec (a tracker's service) would keep the run dir locked after the trainer
    is gone, were the lock's descriptor passed on."""
    paths = RunPaths(tmp_path / "run")
    with paths.lock():
        (fd,) = launched_fds(paths)
        probe = ("import subprocess, sys; from trainer.parallel.launch import exit_with_parent\n"
                 "if sys.argv[1] == 'launched': exit_with_parent()\n"
                 f"sys.exit(subprocess.run(['test', '-e', '/proc/self/fd/{fd}'], close_fds=False).returncode)")
        codes = {how: subprocess.run([sys.executable, "-c", probe, how], cwd=REPO_ROOT, pass_fds=(fd,),
                                     env={**os.environ, **launched_env()}).returncode for how in ("plain", "launched")}
    assert codes == {"plain": 0, "launched": 1}  # without exit_with_parent, its child has the lock's descriptor
