"""trainer/precision.py in the loop's own step: bf16 autocast over fp32 master weights, fp16 dynamic loss scaling."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from core.rundir import RunPaths
from tests.trainer.conftest import MakeRunDir, exported_weights, fresh_accelerator
from trainer import precision
from trainer.loop import TrainingLoop
from trainer.metrics.sink import read_metric_rows
from trainer.train import build_training_loop, main, read_trainer_config


def build_loop(run_dir: Path) -> TrainingLoop:
    """A TrainingLoop exactly as trainer.train builds it (precision warnings on CPU silenced)."""
    config = read_trainer_config(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return build_training_loop(RunPaths(run_dir), config, fresh_accelerator(config.train))


def weights(loop: TrainingLoop) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in loop.accelerator.unwrap_model(loop.model).named_parameters()}


def record_matmul_dtypes(loop: TrainingLoop) -> list[torch.dtype]:
    """Output dtypes of the first block's q_proj, appended on every forward."""
    seen: list[torch.dtype] = []
    q_proj = loop.accelerator.unwrap_model(loop.model).model.layers[0].self_attn.q_proj
    q_proj.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    return seen


def test_bf16_computes_in_bf16_but_keeps_fp32_master_weights_and_optimizer_state(make_run_dir: MakeRunDir) -> None:
    loop = build_loop(make_run_dir(train={"precision": "bf16"}))
    matmul_dtypes = record_matmul_dtypes(loop)
    before = weights(loop)
    for _ in range(2):
        assert loop.train_step().applied
    assert set(matmul_dtypes) == {torch.bfloat16}
    after = weights(loop)
    assert all(param.dtype == torch.float32 for param in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in after)  # fp32 weights take the small updates
    adam_state = loop.optimizer.state_dict()["state"][0]
    assert adam_state["exp_avg"].dtype == adam_state["exp_avg_sq"].dtype == torch.float32
    assert loop.precision.scaler is None and loop.precision.loss_scale is None


def test_fp16_overflow_skips_the_step_halves_the_scale_then_grows_it_back(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir(train={"precision": "fp16", "loss_scale_growth_interval": 2, "max_steps": 20,
                                  "micro_batch_size": 2, "eval_batches": 1})
    loop = build_loop(run_dir)
    matmul_dtypes = record_matmul_dtypes(loop)
    assert loop.train_step().applied
    assert set(matmul_dtypes) == {torch.float16}  # really fp16 on CPU, not Accelerate's silent fp32
    scale = loop.precision.loss_scale
    assert scale == 2.0**16

    overflow = {"inject": True}
    norm_weight = loop.accelerator.unwrap_model(loop.model).model.norm.weight
    norm_weight.register_hook(lambda grad: grad * math.inf if overflow["inject"] else grad)
    before, lr_before = weights(loop), loop.optimizer.param_groups[0]["lr"]
    result = loop.train_step()
    assert not result.applied and math.isfinite(result.loss)
    assert all(torch.equal(before[name], param) for name, param in weights(loop).items())  # update skipped
    assert loop.precision.loss_scale == scale / 2
    assert loop.counters.skipped_steps == 1 and loop.counters.nonfinite_in_a_row == 0  # the scaler's business
    assert loop.optimizer.param_groups[0]["lr"] == lr_before  # the schedule counts applied updates only

    loop.checkpointer.save(loop.counters.step)
    resumed = build_loop(run_dir)
    assert resumed.checkpointer.load_latest() == 2
    assert resumed.precision.loss_scale == scale / 2  # the scaler state is part of the checkpoint

    overflow["inject"] = False
    for _ in range(2):  # growth_interval clean steps double the scale again
        assert loop.train_step().applied
    assert loop.precision.loss_scale == scale
    assert not all(torch.equal(before[name], param) for name, param in weights(loop).items())


def test_fp32_has_no_autocast_and_no_scaler(make_run_dir: MakeRunDir) -> None:
    loop = build_loop(make_run_dir())
    matmul_dtypes = record_matmul_dtypes(loop)
    loop.train_step()
    assert matmul_dtypes == [torch.float32] and loop.precision.state_dict() == {}


def test_bf16_run_on_a_cpu_without_bf16_warns_trains_and_exports_fp32(make_run_dir: MakeRunDir,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_native", lambda name: False)
    run_dir = make_run_dir(train={"max_steps": 2, "precision": "bf16", "eval_every": 2})
    with pytest.warns(UserWarning, match=r"train\.precision=bf16 on CPU: without AVX512-BF16/AMX"):
        assert main(["--run-dir", str(run_dir)]) == 0
    rows = read_metric_rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in rows] == [0, 2] and rows[-1]["val_loss"] < 7.0
    assert exported_weights(run_dir)["model.norm.weight"].dtype == torch.float32
