"""Two "machines" on 127.0.0.1, one process each, started by Accelerate's multi-machine launch (gloo)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.trainer.conftest import MakeRunDir, metric_steps
from trainer.parallel.launch import launch_command

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


def launch_two_machines(run_dir: Path, logs_dir: Path, timeout_s: float) -> tuple[list[int], list[str]]:
    """Both machines' launches on a fresh port -> (exit codes, outputs); fails the test, showing both outputs,
    when they do not finish in time. Each writes to a file, so neither can block on a full pipe."""
    port = free_port()
    logs = [logs_dir / f"machine-{rank}.log" for rank in (0, 1)]
    machines = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            machines.append(subprocess.Popen(
                launch_command(run_dir, 2, num_machines=2, machine_rank=rank, main_process_ip="127.0.0.1",
                               main_process_port=port),
                cwd=REPO_ROOT, env=clean_environment(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        codes = [machine.wait(timeout=max(0.0, deadline - time.monotonic())) for machine in machines]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for machine in machines:
            if machine.poll() is None:  # the ranks run in sessions of their own: kill each process of the tree
                launcher = psutil.Process(machine.pid)
                for process in [*launcher.children(recursive=True), launcher]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                machine.wait()
    outputs = [log.read_text() for log in logs]
    assert codes is not None, f"the launches did not finish within {timeout_s} s:\n" + "\n".join(outputs)
    return codes, outputs


def test_two_machines_with_one_process_each_train_together(make_run_dir: MakeRunDir, tmp_path: Path) -> None:
    run_dir = make_run_dir(train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 2})
    # ~6 s alone. Before trainer.train kept the prepared model alive until exit, 4 runs in ~74 hung after the
    # export (gloo's process-group destructor against its worker thread, over the GIL) until this timeout.
    codes, outputs = launch_two_machines(run_dir, tmp_path, timeout_s=150)
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "on 2 process(es)" in outputs[0]  # one process group across both launches, not two lone runs
    assert metric_steps(run_dir, "eval.jsonl")[-1] == 4
    assert (run_dir / "checkpoints" / "step-0000004" / "manifest.json").is_file()
    assert (run_dir / "model" / "model.safetensors").is_file()
