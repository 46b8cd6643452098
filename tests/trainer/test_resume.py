"""Exact resume across processes: ``kill -9`` of ``python -m trainer.train`` at a random moment, then a re-run.

The final weights must be bitwise those of a run that was never interrupted (CPU, fp32, deterministic
kernels): the checkpoint restores weights, AdamW state, schedule, RNG, loader position and counters.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import MakeRunDir
from trainer.metrics.sink import read_metric_rows
from trainer.train import main

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"max_steps": 40, "checkpoint_every": 5, "eval_every": 20, "log_every": 1, "micro_batch_size": 8}
DIMS = {"hidden_size": 64, "intermediate_size": 128}


def start_training(run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)], cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def logged_step(run_dir: Path) -> int:
    """The newest step in metrics/train.jsonl (0 before the first row)."""
    path = run_dir / "metrics" / "train.jsonl"
    rows = read_metric_rows(path) if path.is_file() else []
    return rows[-1]["step"] if rows else 0


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    """Return as soon as ``step`` is logged (rows are written every step) while ``process`` runs.

    Polls gently: a busy poller on a 2-core machine would slow the trainer's two OpenMP threads a lot.
    """
    start = time.monotonic()
    while logged_step(run_dir) < step:
        assert process.poll() is None, f"training exited with {process.returncode} before step {step}"
        assert time.monotonic() - start < timeout_s, f"step {step} not reached in time"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_is_bitwise_identical(make_run_dir: MakeRunDir) -> None:
    straight = make_run_dir("straight", train=SETTINGS, dims=DIMS)
    assert main(["--run-dir", str(straight)]) == 0  # uninterrupted (in this process: same kernels, same threads)
    expected = (straight / "model" / "model.safetensors").read_bytes()

    for seed in (1, 2):
        run_dir = make_run_dir(f"killed-{seed}", train=SETTINGS, dims=DIMS)
        log = run_dir / "train.log"
        process = start_training(run_dir, log)
        # A random moment after the first checkpoint: a random step, then a random fraction of a step
        # (so the kill lands in forward/backward, an optimizer step, a metrics write or a checkpoint save).
        rng = random.Random(seed)
        wait_for_step(run_dir, rng.randint(SETTINGS["checkpoint_every"] + 1, SETTINGS["max_steps"] - 20), process)
        time.sleep(rng.uniform(0.0, 0.02))
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL  # killed mid-run, not finished already
        assert not (run_dir / "model" / "model.safetensors").exists()

        resumed = start_training(run_dir, log)
        assert resumed.wait(timeout=300) == 0, log.read_text()[-2000:]
        output = log.read_text()
        assert "Resuming from checkpoint at step " in output
        resumed_step = int(output.split("Resuming from checkpoint at step ")[1].split()[0])
        assert SETTINGS["checkpoint_every"] <= resumed_step < SETTINGS["max_steps"]
        assert (run_dir / "model" / "model.safetensors").read_bytes() == expected, f"seed {seed}: weights differ"
