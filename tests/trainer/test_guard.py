"""trainer/guard.py in whole runs: a NaN step is skipped and counted; K in a row stop with the last good checkpoint."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from tests.trainer.conftest import MakeRunDir, exported_weights, metric_steps
from trainer.guard import NonFiniteGuard
from trainer.loop import LoopCounters
from trainer.metrics.sink import read_metric_rows
from trainer.model.llama import LlamaForCausalLM
from trainer.train import main


def poison_training_losses(monkeypatch: pytest.MonkeyPatch, is_bad: Callable[[int], bool]) -> None:
    """Test hook: the n-th training forward (grad on; 1-based) returns NaN logits when ``is_bad(n)``."""
    original = LlamaForCausalLM.forward
    calls = itertools.count(1)

    def forward(self: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = original(self, input_ids, labels)
        if torch.is_grad_enabled() and is_bad(next(calls)):
            return out * math.nan
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)


def test_guard_decisions() -> None:
    counters = LoopCounters()
    guard = NonFiniteGuard(max_in_a_row=2, counters=counters)
    assert guard.is_finite(1.0, 0.5, loss_scaled=False)
    assert not guard.is_finite(math.nan, 0.5, loss_scaled=False)
    assert not guard.is_finite(1.0, math.inf, loss_scaled=False)
    assert guard.is_finite(1.0, math.inf, loss_scaled=True)  # an fp16 overflow: the scaler skips it
    assert guard.is_finite(1.0, None, loss_scaled=False)  # no norm known (DeepSpeed clips inside)
    guard.record(finite=False, applied=False)
    assert guard.in_streak and not guard.should_stop
    guard.record(finite=False, applied=False)
    assert guard.should_stop and counters.skipped_steps == 2
    guard.record(finite=True, applied=True)
    assert not guard.in_streak and counters.skipped_steps == 2


def test_one_nan_step_is_skipped_and_counted(make_run_dir: MakeRunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = make_run_dir(train={"max_steps": 6, "log_every": 1, "checkpoint_every": 3})
    poison_training_losses(monkeypatch, lambda call: call == 3)
    assert main(["--run-dir", str(run_dir)]) == 0
    rows = {row["step"]: row for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")}
    assert rows[3]["loss"] is None and rows[3]["skipped_steps"] == 1  # NaN is written as null
    assert [rows[step]["skipped_steps"] for step in (1, 2, 4, 6)] == [0, 0, 1, 1]
    assert rows[4]["lr"] == rows[3]["lr"]  # the skipped step did not advance the schedule
    assert all(torch.isfinite(tensor).all() for tensor in exported_weights(run_dir).values())


def test_too_many_nan_steps_in_a_row_stop_with_the_last_good_checkpoint(
        make_run_dir: MakeRunDir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"max_steps": 10, "log_every": 5, "checkpoint_every": 2,
                                  "max_nonfinite_steps": 3})
    poison_training_losses(monkeypatch, lambda call: call >= 4)  # e.g. the weights went bad after step 3
    assert main(["--run-dir", str(run_dir)]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip()
    assert error.count("\n") == 0 and error.startswith("error: step 6: non-finite loss or gradient norm for 3 steps")
    assert "(since step 4; train.max_nonfinite_steps=3); last good checkpoint: checkpoints/step-0000002" in error
    assert "checkpoint at step 4 skipped" in captured.out  # a streak never becomes the newest checkpoint
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-0000002"]
    assert metric_steps(run_dir, "train.jsonl")[-1] == 6  # the stopping step is logged
    assert not (run_dir / "model").exists()
