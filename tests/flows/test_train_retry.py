"""Killing the training child mid-run: the train task's retry resumes from the newest checkpoint."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.flows.conftest import Recorder, write_small_recipe

pytestmark = pytest.mark.slow


def kill_trainer_after_first_checkpoint(run_dir: Path, timeout_s: float = 300) -> int:
    """Wait for checkpoint step 10, then SIGKILL the `trainer.train` process; return the step it was at."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (run_dir / "checkpoints" / "step-0000010" / "manifest.json").is_file():
            for process in psutil.Process().children(recursive=True):
                try:  # children come and go (the launcher's probes): a vanished one is not an error
                    command = " ".join(process.cmdline())
                    if "trainer.train" in command and "accelerate.commands.launch" not in command:
                        process.kill()
                        return 10
                except psutil.Error:
                    continue
        time.sleep(0.02)
    raise AssertionError("no checkpoint appeared")


def test_killed_training_child_is_retried_and_resumes(tmp_path: Path, prefect_server: None) -> None:
    from flows.pipeline import prepare_data, train_model

    recipe = write_small_recipe(tmp_path, max_steps=200)
    data = yaml.safe_load(recipe.read_text())  # a model big enough that training lasts seconds after step 10
    data["model"]["dims"].update(hidden_size=128, intermediate_size=256)
    recipe.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    prepare_data(str(recipe))
    killer = threading.Thread(target=kill_trainer_after_first_checkpoint, args=(run_dir,), daemon=True)
    killer.start()
    recorder, task_logger = Recorder(), logging.getLogger("prefect.task_runs")
    task_logger.addHandler(recorder)
    try:
        summary = train_model(str(recipe))
    finally:
        task_logger.removeHandler(recorder)
    killer.join(timeout=5)

    assert summary["final_step"] == 200
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), "steps replayed after the restart must not be logged twice"
    # The train task's own log (the trainer's lines are streamed into it). The first attempt started from
    # scratch, so a resume inside this one train_model call can only come from the task's retry.
    assert any("Resuming from checkpoint at step 10" in m for m in recorder.messages), "the retry resumed"
