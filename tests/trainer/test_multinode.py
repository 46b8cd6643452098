"""Two "machines" on 127.0.0.1, one process each, started by Accelerate's multi-machine launch (gloo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.trainer.conftest import MakeRunDir, metric_steps
from trainer.launch import launch_command

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_environment() -> dict[str, str]:
    """This process's environment without distributed settings that in-process tests may have left behind."""
    leftovers = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {key: value for key, value in os.environ.items()
            if key not in leftovers and not key.startswith(("ACCELERATE_", "TORCHELASTIC_"))}


def launch_two_machines(run_dir: Path, timeout_s: float) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """Both machines' launches on a fresh port; raises TimeoutExpired when they do not finish in time."""
    port = free_port()
    machines = [subprocess.Popen(launch_command(run_dir, 2, num_machines=2, machine_rank=rank,
                                                main_process_ip="127.0.0.1", main_process_port=port),
                                 cwd=REPO_ROOT, env=clean_environment(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
                for rank in (0, 1)]
    try:
        return machines, [machine.communicate(timeout=timeout_s)[0] for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)


def test_two_machines_with_one_process_each_train_together(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir(train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 2})
    try:
        machines, outputs = launch_two_machines(run_dir, timeout_s=150)  # ~10 s alone, ~60 s on a loaded machine
    except subprocess.TimeoutExpired:
        # Once, on a busy machine, both launches hung until the timeout; the likely cause is the free port being
        # taken by another process before the launch bound it, after which the rendezvous waits forever. A
        # second try on a new port resumes from any checkpoint made; a launch that fails is not retried.
        machines, outputs = launch_two_machines(run_dir, timeout_s=150)
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "on 2 process(es)" in outputs[0]  # one process group across both launches, not two lone runs
    assert metric_steps(run_dir, "eval.jsonl")[-1] == 4
    assert (run_dir / "checkpoints" / "step-0000004" / "manifest.json").is_file()
    assert (run_dir / "model" / "model.safetensors").is_file()
