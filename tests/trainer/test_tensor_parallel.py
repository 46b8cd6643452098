"""trainer/parallel/accelerator.py, trainer/checkpoint/checkpointer.py: tensor parallelism on CPU processes (gloo) via a
real ``accelerate launch``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.errors import ConfigError
from tests.trainer.conftest import MakeRunDir, edit_recipe, exported_weights
from tests.trainer.test_parallel import FP32_ATOL, launch, max_weight_difference, one_process_reference
from trainer.checkpoint.checkpointer import verify_checkpoint
from trainer.config import TrainConfig
from trainer.metrics.sink import read_metric_rows
from trainer.parallel.accelerator import build_accelerator
from trainer.train import main, read_trainer_config

SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 3, "log_every": 1}


def losses(run_dir: Path, name: str, key: str) -> list[float]:
    """One column of a metrics file, in row order."""
    return [row[key] for row in read_metric_rows(run_dir / "metrics" / name)]


@pytest.mark.slow
def test_tensor_parallel_on_two_processes_matches_one_process_and_resumes(
        make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={**SETTINGS, "num_processes": 2, "tensor_parallel_size": 2,
                                  "activation_checkpointing": True})
    launch(run_dir, 2, until_step=2)
    stdout = launch(run_dir, 2)  # resumes from the tensor-parallel checkpoint
    assert "Resuming from checkpoint at step 2" in stdout
    assert "on 2 process(es), 256 tokens/step" in stdout  # one replica: both processes read the same batch
    for step in (2, 4):
        folder = run_dir / "checkpoints" / f"step-{step:07d}"
        manifest = json.loads((folder / "manifest.json").read_text())["files"]
        assert {"tensor_parallel/tp_rank_0.safetensors", "tensor_parallel/tp_rank_1.safetensors",
                "tensor_parallel/layout.json", "scheduler.bin", "random_states_1.pkl"} <= set(manifest)
        assert "model.safetensors" not in manifest and "optimizer.bin" not in manifest
        assert verify_checkpoint(folder) is None

    # Splitting the matmuls changes the order of fp32 sums, not the maths (the same global batch, 4 steps
    # with a resume in the middle); the export holds the whole weights under HF's names.
    reference = make_run_dir("reference", train=SETTINGS)
    assert main(["--run-dir", str(reference)]) == 0
    difference = max_weight_difference(run_dir, reference)
    assert difference < FP32_ATOL
    assert {name: t.shape for name, t in exported_weights(run_dir).items()} == {
        name: t.shape for name, t in exported_weights(reference).items()}
    assert losses(run_dir, "train.jsonl", "loss") == pytest.approx(losses(reference, "train.jsonl", "loss"), abs=1e-5)
    assert losses(run_dir, "eval.jsonl", "val_loss") == pytest.approx(losses(reference, "eval.jsonl", "val_loss"),
                                                                      abs=1e-5)
    assert losses(run_dir, "eval.jsonl", "val_tokens") == losses(reference, "eval.jsonl", "val_tokens")

    # A tensor-parallel checkpoint is refused, with the fix, by a run without tensor parallelism.
    edit_recipe(run_dir, "train", tensor_parallel_size=1, max_steps=6)
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 2
    assert "saved with train.tensor_parallel_size 2, this run has 1; set it back to 2" in capsys.readouterr().err
    print(f"tensor parallel (2 processes) vs 1 process: max weight difference {difference:.3g}")  # shown with -s


@pytest.mark.slow
def test_two_replicas_of_two_tensor_parallel_processes_match_one_process(make_run_dir: MakeRunDir) -> None:
    settings = {**SETTINGS, "max_steps": 2}
    run_dir = make_run_dir(train={**settings, "num_processes": 4, "tensor_parallel_size": 2})
    stdout = launch(run_dir, 4)
    assert "on 4 process(es), 512 tokens/step" in stdout  # 2 data-parallel replicas of 256 tokens
    assert set(json.loads((run_dir / "checkpoints" / "step-0000002" / "manifest.json").read_text())["files"]) >= {
        "tensor_parallel/tp_rank_0.safetensors", "tensor_parallel/tp_rank_1.safetensors", "random_states_3.pkl"}
    reference = one_process_reference(make_run_dir, settings, until_step=2)
    difference = max_weight_difference(run_dir, reference)
    print(f"2 replicas x tensor parallel 2 (4 processes) vs 1 process: max weight difference {difference:.3g}")
    assert difference < FP32_ATOL


def test_a_bad_tensor_parallel_size_is_a_one_line_config_error(make_run_dir: MakeRunDir,
                                                               capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"num_processes": 3, "tensor_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"train\.tensor_parallel_size 3 must divide the model num_heads \(4\)"):
        read_trainer_config(run_dir)
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "train.tensor_parallel_size" in err

    with pytest.raises(ValidationError, match=r"train\.tensor_parallel_size 2 must divide train\.num_processes 3"):
        TrainConfig(num_processes=3, tensor_parallel_size=2)
    with pytest.raises(ValidationError, match=r"cannot be combined with train\.fsdp"):
        TrainConfig(num_processes=2, tensor_parallel_size=2, fsdp=True)
    with pytest.raises(ValidationError, match=r"cannot be combined with train\.precision fp16"):
        TrainConfig(num_processes=2, tensor_parallel_size=2, precision="fp16")
    # The recipe asks for 2 processes, but this one runs alone.
    with pytest.raises(ConfigError, match=r"must divide the 1 launched process\(es\)"):
        build_accelerator(TrainConfig(num_processes=2, tensor_parallel_size=2))
