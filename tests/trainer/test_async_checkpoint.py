"""``train.async_checkpoint``: ``kill -9`` while a background save is writing keeps the previous checkpoint, and the
re-run, resuming from a checkpoint the background thread wrote, ends bitwise where a never-interrupted synchronous
run ends (tests/trainer/test_checkpoint.py checks that the written state is the step boundary's while training
goes on, and that a failed background write is raised as one line).

The in-flight window is made long and deterministic with ``TOKENMILL_CHECKPOINT_WRITE_DELAY_S`` (the writer sleeps
before each file; docs/training.md): a tiny model's save takes milliseconds, and racing a poller against it would
make the test pass by luck or flake. Nothing is replaced: the real trainer writes the real files, only slower.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.files.atomic import TEMP_PREFIX
from tests.trainer.conftest import MakeRunDir, metric_steps
from trainer.checkpoint.checkpointer import list_checkpoints, verify_checkpoint
from trainer.checkpoint.writer import WRITE_DELAY_ENV
from trainer.train import main

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 4, "log_every": 1}
DELAY_S = 0.5
"""Per file of a background save (4 sleeps): a ~2 s window for the poller below to see, at 20 ms a look."""


def wait_for(condition_met, process: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    """Poll gently (a 2-core machine) until ``condition_met()`` while ``process`` runs."""
    start = time.monotonic()
    while not condition_met():
        assert process.poll() is None, f"training exited with {process.returncode} before {what}"
        assert time.monotonic() - start < timeout_s, f"{what}: not in {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_during_a_background_save_keeps_the_previous_checkpoint_and_resume_is_bitwise(
        make_run_dir: MakeRunDir) -> None:
    straight = make_run_dir("straight", train=SETTINGS)
    assert main(["--run-dir", str(straight)]) == 0  # synchronous saves, never interrupted
    run_dir = make_run_dir("killed", train={**SETTINGS, "async_checkpoint": True})
    checkpoints = run_dir / "checkpoints"
    log = run_dir / "train.log"
    with open(log, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)], cwd=REPO_ROOT,
                                   stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", WRITE_DELAY_ENV: str(DELAY_S)})
    # The step-4 save (the last) starts only once the step-2 one is published; its folder is then being written.
    in_flight = checkpoints / f"{TEMP_PREFIX}step-0000004"
    wait_for(lambda: (in_flight / "random_states_0.pkl").is_file(), process, "the step-4 background save")
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL

    assert [step for step, _ in list_checkpoints(checkpoints)] == [2]
    assert verify_checkpoint(checkpoints / "step-0000002") is None
    assert json.loads((checkpoints / "latest").read_text())["step"] == 2
    assert not (in_flight / "manifest.json").exists(), "killed mid-save, not after it"

    with open(log, "ab") as out:  # no delay now: an ordinary async run
        resumed = subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)], cwd=REPO_ROOT,
                                 stdout=out, stderr=subprocess.STDOUT, check=False)
    output = log.read_text()
    assert resumed.returncode == 0, output[-3000:]
    assert "Resuming from checkpoint at step 2" in output
    assert (run_dir / "model" / "model.safetensors").read_bytes() == \
        (straight / "model" / "model.safetensors").read_bytes()
    assert metric_steps(run_dir, "train.jsonl") == list(range(1, 5))
    assert not in_flight.exists()  # the killed save's leftovers are cleared on resume
    # Both hold exactly the synchronous run's state (step 2 was written in the background as training went on).
    for step in (2, 4):
        assert checkpoint_hashes(checkpoints, step) == checkpoint_hashes(straight / "checkpoints", step)


def checkpoint_hashes(checkpoints: Path, step: int) -> dict[str, str]:
    """sha256 by file of a checkpoint, but the RNG pickles: they record Accelerate's micro-step counter, which
    a resume restarts at 0 (trainer.checkpoint.checkpointer resets it), so they differ between a resumed and a straight
    run."""
    manifest = json.loads((checkpoints / f"step-{step:07d}" / "manifest.json").read_text())
    return {name: entry["sha256"] for name, entry in manifest["files"].items()
            if not name.startswith("random_states_")}
