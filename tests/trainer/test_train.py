"""trainer/train.py, loop.py, evaluate.py, metrics.py, launch.py: whole runs on real shards, resume, 2 processes."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from pipeline.errors import ConfigError
from tests.trainer.conftest import MakeRunDir, fresh_accelerator
from trainer.data import SplitRows
from trainer.evaluate import Evaluator
from trainer.launch import launch_command
from trainer.loop import lr_factor, mixed_precision_for
from trainer.metrics import read_metric_rows
from trainer.model import ModelShape, build_model
from trainer.train import main, read_trainer_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def metric_steps(run_dir: Path, name: str) -> list[int]:
    return [row["step"] for row in read_metric_rows(run_dir / "metrics" / name)]


def exported_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def edit_recipe(run_dir: Path, section: str, **changes: object) -> None:
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe[section] = {**recipe[section], **changes}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))


def test_recipe_errors_name_the_key(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir(train={"max_step": 3})
    with pytest.raises(ConfigError, match=r"run\.yaml: train\.max_step: unknown key"):
        read_trainer_config(run_dir)
    with pytest.raises(ConfigError, match="run recipe file not found"):
        read_trainer_config(run_dir / "missing")


def test_precision_fp16_refused_and_bf16_warned_on_cpu() -> None:
    assert mixed_precision_for("fp32", on_gpu=False) == "no"
    with pytest.raises(ConfigError, match=r"train\.precision=fp16.*set train\.precision: fp32"):
        mixed_precision_for("fp16", on_gpu=False)
    with pytest.warns(UserWarning, match="slower than fp32"):
        assert mixed_precision_for("bf16", on_gpu=False) == "bf16"
    assert mixed_precision_for("fp16", on_gpu=True) == "fp16"


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    factors = [lr_factor(step, warmup_steps=4, max_steps=20, min_lr_ratio=0.1) for step in range(25)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))
    assert factors[20] == pytest.approx(0.1) == factors[24]


def test_loss_decreases_and_every_output_is_written(make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"max_steps": 40, "eval_every": 20, "checkpoint_every": 20, "log_every": 10,
                                  "lr": 1e-2, "warmup_steps": 4, "eval_batches": 4})
    assert main(["--run-dir", str(run_dir)]) == 0
    evals = read_metric_rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in evals] == [0, 20, 40]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert evals[-1]["val_ppl"] == pytest.approx(torch.tensor(evals[-1]["val_loss"]).exp().item(), rel=1e-6)
    train_rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in train_rows] == [1, 10, 20, 30, 40]
    assert {"loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "step_time_s"} <= set(train_rows[-1])
    assert train_rows[-1]["tokens_seen"] == 40 * 4 * 64
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-0000020", "step-0000040"]
    assert json.loads((run_dir / "model" / "config.json").read_text())["vocab_size"] == 512
    out = capsys.readouterr().out
    assert "step 40/40 | loss" in out and "tokens/s" in out

    final = exported_weights(run_dir)
    (run_dir / "model" / "model.safetensors").unlink()  # e.g. killed after the last checkpoint, before export
    assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 40" in capsys.readouterr().out
    assert all(torch.equal(final[k], v) for k, v in exported_weights(run_dir).items())
    assert metric_steps(run_dir, "eval.jsonl") == [0, 20, 40]


def test_resume_is_bitwise_equal_to_an_uninterrupted_run(make_run_dir: MakeRunDir,
                                                         capsys: pytest.CaptureFixture) -> None:
    settings = {"max_steps": 7, "checkpoint_every": 2, "eval_every": 3, "log_every": 1, "grad_accum_steps": 2}
    straight, resumed = make_run_dir("straight", train=settings), make_run_dir("resumed", train=settings)
    assert main(["--run-dir", str(straight)]) == 0
    assert main(["--run-dir", str(resumed), "--until-step", "5"]) == 0  # checkpoints at 4 and 5
    assert metric_steps(resumed, "train.jsonl") == [1, 2, 3, 4, 5]
    # Simulate a kill after step 5 was logged but before its checkpoint: resume must start at 4.
    for folder in (resumed / "checkpoints").glob("step-0000005"):
        shutil.rmtree(folder)
    capsys.readouterr()
    assert main(["--run-dir", str(resumed)]) == 0
    assert "Resuming from checkpoint at step 4" in capsys.readouterr().out
    straight_weights, resumed_weights = exported_weights(straight), exported_weights(resumed)
    assert all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights)
    assert metric_steps(resumed, "train.jsonl") == list(range(1, 8))  # no duplicate rows from the replayed step
    assert metric_steps(resumed, "eval.jsonl") == [0, 3, 6, 7]
    straight_rows = read_metric_rows(straight / "metrics" / "train.jsonl")
    resumed_rows = read_metric_rows(resumed / "metrics" / "train.jsonl")
    assert [row["loss"] for row in straight_rows] == [row["loss"] for row in resumed_rows]


def test_changed_model_is_refused_on_resume(make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"max_steps": 2, "checkpoint_every": 2})
    assert main(["--run-dir", str(run_dir)]) == 0
    edit_recipe(run_dir, "model", dims={"hidden_size": 48, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                        "intermediate_size": 64})
    edit_recipe(run_dir, "train", max_steps=4)
    assert main(["--run-dir", str(run_dir)]) == 2
    assert "differs from the recipe's" in capsys.readouterr().err


def test_launch_command_forms() -> None:
    one = launch_command(Path("runs/x"), 1)
    two = launch_command(Path("runs/x"), 2, until_step=7)
    assert one[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and "--multi_gpu" not in one
    assert one[-4:] == ["-m", "trainer.train", "--run-dir", "runs/x"]
    assert two[two.index("--num_processes") + 1] == "2" and "--multi_gpu" in two
    assert two[-2:] == ["--until-step", "7"]


@pytest.mark.slow
def test_two_process_launch_then_resume_on_one_process(make_run_dir: MakeRunDir,
                                                       capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"max_steps": 6, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 3})
    completed = subprocess.run(launch_command(run_dir, 2, until_step=4), cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "on 2 process(es), 512 tokens/step" in completed.stdout
    checkpoint = run_dir / "checkpoints" / "step-0000004"
    assert {"random_states_0.pkl", "random_states_1.pkl", "manifest.json"} <= {p.name for p in checkpoint.iterdir()}
    assert metric_steps(run_dir, "eval.jsonl") == [0, 2, 4]

    # The 2-rank evaluation (gathered sums) equals a 1-process evaluation of the same weights.
    config = read_trainer_config(run_dir)
    rows = SplitRows(run_dir, "val")
    model = build_model(ModelShape(config.model.resolved_dims(), rows.vocab_size, rows.seq_len), seed=1)
    model.load_state_dict(exported_weights(run_dir))
    single = Evaluator(rows, micro_batch_size=4, eval_batches=3, accelerator=fresh_accelerator()).evaluate(model)
    two_rank = read_metric_rows(run_dir / "metrics" / "eval.jsonl")[-1]
    assert single["val_loss"] == pytest.approx(two_rank["val_loss"], abs=1e-5)
    assert single["val_tokens"] == two_rank["val_tokens"] == 3 * 4 * 63

    # The same global batch on one process (grad accumulation doubled) resumes without complaint.
    edit_recipe(run_dir, "train", grad_accum_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 4" in capsys.readouterr().out
    assert metric_steps(run_dir, "train.jsonl")[-1] == 6



def test_bf16_run_trains_with_a_warning(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir(train={"max_steps": 2, "precision": "bf16", "eval_every": 2})
    with pytest.warns(UserWarning, match=r"train\.precision=bf16 on CPU"):
        assert main(["--run-dir", str(run_dir)]) == 0
    rows = read_metric_rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in rows] == [0, 2] and rows[-1]["val_loss"] < 7.0
    assert exported_weights(run_dir)["model.norm.weight"].dtype == torch.float32
