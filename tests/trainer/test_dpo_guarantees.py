"""``train.mode: dpo`` keeps pretraining's guarantees: 2 processes (DDP over gloo, a real ``accelerate launch``) equal
1 process with doubled accumulation, and resume on 1 (elastic 2 -> 1), the rewards taken over every rank's pairs; and
``kill -9`` at a random moment then a re-run gives bitwise the weights of an uninterrupted run."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from tests.trainer.conftest import Corpus, edit_recipe
from tests.trainer.preference_run import make_preference_run_dir
from tests.trainer.test_lora import LORA
from tests.trainer.test_parallel import FP32_ATOL, launch, max_weight_difference
from tests.trainer.test_resume import start_training, wait_for_step
from trainer.metrics.sink import read_metric_rows
from trainer.train import main

ELASTIC_SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 2, "log_every": 1,
                    "micro_batch_size": 2}
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")


@pytest.mark.slow
def test_dpo_on_two_processes_then_one_equals_one_straight_through(tmp_path: Path, stdlib_corpus: Corpus,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's micro-batches hold other numbers of pairs; the step is the mean over all of them, and its logged
    pairs and rewards are every rank's (rank 0's alone would differ from 1 process)."""
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, "elastic", **ELASTIC_SETTINGS, num_processes=2)
    launch(run_dir, 2, until_step=2)
    edit_recipe(run_dir, "train", grad_accum_steps=2, num_processes=1)
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 2" in capsys.readouterr().out

    straight = make_preference_run_dir(tmp_path, stdlib_corpus, "straight", **ELASTIC_SETTINGS, grad_accum_steps=2)
    assert main(["--run-dir", str(straight)]) == 0
    assert max_weight_difference(run_dir, straight) < FP32_ATOL
    elastic_rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    straight_rows = read_metric_rows(straight / "metrics" / "train.jsonl")
    assert [row["step"] for row in elastic_rows] == [row["step"] for row in straight_rows] == [1, 2, 3, 4]
    for two, one in zip(elastic_rows, straight_rows, strict=True):
        assert (two["pairs"], two["pairs_seen"]) == (one["pairs"], one["pairs_seen"])
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5)
        assert [two[key] for key in REWARDS] == pytest.approx([one[key] for key in REWARDS], abs=1e-5)
    assert straight_rows[1]["rewards/margin"] != 0.0
    evals = [read_metric_rows(folder / "metrics" / "eval.jsonl") for folder in (run_dir, straight)]
    assert [row["step"] for row in evals[0]] == [0, 2, 4]
    for two, one in zip(*evals, strict=True):
        assert (two["val_loss"], two["rewards/margin"]) == pytest.approx((one["val_loss"], one["rewards/margin"]),
                                                                         abs=1e-5)


RESUME_SETTINGS = {"max_steps": 8, "checkpoint_every": 3, "eval_every": 8, "eval_batches": 1, "log_every": 1,
                   "micro_batch_size": 2, "grad_accum_steps": 2, "lora": {**LORA, "dropout": 0.1}}
"""LoRA with dropout on: the one kill -9 test of adapters too (their weights and AdamW state in the checkpoint, the
RNG their dropout draws from continued), whatever the mode: the SFT loss reads its rows as the DPO loss does."""


@pytest.mark.slow
def test_dpo_sigkill_at_a_random_moment_then_resume_is_bitwise_identical(tmp_path: Path,
                                                                         stdlib_corpus: Corpus) -> None:
    straight = make_preference_run_dir(tmp_path, stdlib_corpus, "straight", **RESUME_SETTINGS)
    assert main(["--run-dir", str(straight)]) == 0
    expected = (straight / "model" / "model.safetensors").read_bytes()

    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, "killed", **RESUME_SETTINGS)
    log = run_dir / "train.log"
    process = start_training(run_dir, log)
    rng = random.Random(3)  # a random step after the first checkpoint, then a random fraction of a step
    wait_for_step(run_dir, rng.randint(RESUME_SETTINGS["checkpoint_every"] + 1, RESUME_SETTINGS["max_steps"] - 3),
                  process)
    time.sleep(rng.uniform(0.0, 0.02))
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not (run_dir / "model" / "model.safetensors").exists()

    resumed = start_training(run_dir, log)
    assert resumed.wait(timeout=300) == 0, log.read_text()[-2000:]
    output = log.read_text()
    resumed_step = int(output.split("Resuming from checkpoint at step ")[1].split()[0])
    assert RESUME_SETTINGS["checkpoint_every"] <= resumed_step < RESUME_SETTINGS["max_steps"]
    assert (run_dir / "model" / "model.safetensors").read_bytes() == expected
    rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert rows[-1]["pairs_seen"] == sum(row["pairs"] for row in rows)  # the pairs counted across the resume
