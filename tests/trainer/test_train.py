"""trainer/train.py, loop.py, trainer/eval/evaluate.py, trainer/metrics/sink.py, trainer/parallel/launch.py: whole runs
on real shards, resume, 2 processes."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from tests.trainer.conftest import VOCAB_SIZE, Corpus, MakeRunDir, edit_recipe, exported_weights, metric_steps
from trainer import precision
from trainer.loader.batches import EOS_ID, PAD_ID
from trainer.metrics.sink import read_metric_rows
from trainer.optim import lr_factor
from trainer.parallel.launch import launch_command
from trainer.precision import check_precision
from trainer.train import main, read_trainer_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_recipe_errors_name_the_key(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir(train={"max_step": 3})
    with pytest.raises(ConfigError, match=r"run\.yaml: train\.max_step: unknown key"):
        read_trainer_config(run_dir)
    with pytest.raises(ConfigError, match="run recipe file not found"):
        read_trainer_config(run_dir / "missing")


def test_half_precisions_warn_on_cpus_without_native_support(monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_precision("fp32", on_gpu=False)
    monkeypatch.setattr(precision, "cpu_has_native", lambda name: False)
    for name in ("bf16", "fp16"):
        with pytest.warns(UserWarning, match=rf"train\.precision={name} on CPU.*set train\.precision: fp32"):
            check_precision(name, on_gpu=False)
    monkeypatch.setattr(precision, "cpu_has_native", lambda name: True)  # e.g. AVX512-BF16 / AMX
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_precision("bf16", on_gpu=False)


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
    assert one[:3] == [sys.executable, "-m", "trainer.parallel.launch_one"] and "--multi_gpu" not in one
    assert one[-4:] == ["-m", "trainer.train", "--run-dir", "runs/x"]
    # hands several processes to accelerate launch
    assert two[:3] == [sys.executable, "-m", "trainer.parallel.launch_one"]
    assert two[two.index("--num_processes") + 1] == "2" and "--multi_gpu" in two
    assert two[-2:] == ["--until-step", "7"]
    machines = launch_command(Path("runs/x"), 1, num_machines=1)
    assert machines[:3] == one[:3]


PROBE = """import json, os, sys, torch
names = sorted(name for name in os.environ if name.startswith(("ACCELERATE_", "OMP_", "KMP_", "MASTER_")))
print(json.dumps({"env": {name: os.environ[name] for name in names}, "threads": torch.get_num_threads(),
                  "argv": sys.argv[1:], "main": __name__}))
sys.exit(3)
"""


def test_one_process_launch_gives_the_module_what_accelerate_launch_gives(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.parallel.launch_one runs the module in its own process with the environment, thread count and arguments
    `accelerate launch` gives the child it starts; the module's exit status comes back as it is."""
    (tmp_path / "probe_launch.py").write_text(PROBE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the argv then names the cores: 2 threads here
    ours = launch_command(Path("runs/x"), 1, module="probe_launch", module_args=["--extra"])
    theirs = [sys.executable, "-m", "accelerate.commands.launch", *ours[3:]]
    # The launching process's own 1 thread, as torch in trainer.parallel.launch_one reads it at import: overridden
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    seen = [subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120) for argv in (ours, theirs)]
    assert seen[0].returncode == 3, seen[0].stderr[-2000:]  # accelerate's own launcher turns 3 into 1
    assert seen[1].returncode != 0, seen[1].stderr[-2000:]
    probes = [json.loads(done.stdout.strip().splitlines()[-1]) for done in seen]
    assert probes[0] == probes[1]
    assert probes[0]["argv"] == ["--run-dir", "runs/x", "--extra"] and probes[0]["main"] == "__main__"
    assert probes[0]["env"]["ACCELERATE_MIXED_PRECISION"] == "no"
    assert probes[0]["threads"] == int(ours[ours.index("--num_cpu_threads_per_process") + 1])


def test_launched_ranks_get_the_cores_not_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate launch sets OMP_NUM_THREADS=1 in its ranks unless told otherwise: the flow's CPU trainer ran
    on one core of two. Each rank gets this machine's cores over its ranks; a user's OMP_NUM_THREADS wins."""
    def threads(argv: list[str]) -> str | None:
        flag = "--num_cpu_threads_per_process"
        return argv[argv.index(flag) + 1] if flag in argv else None

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert threads(launch_command(Path("runs/x"), 1)) == "4"
    assert threads(launch_command(Path("runs/x"), 2)) == "2"
    assert threads(launch_command(Path("runs/x"), 8)) == "1"
    assert threads(launch_command(Path("runs/x"), 4, num_machines=2, main_process_ip="127.0.0.1")) == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads(launch_command(Path("runs/x"), 1)) is None  # accelerate passes the user's 3 on


def with_special_ids_moved(corpus: Corpus, eos_id: int, pad_id: int) -> Corpus:
    """The same corpus under a tokenizer whose specials have other ids (as in a loaded tokenizer that gained
    them after training): ids EOS_ID<->eos_id and PAD_ID<->pad_id swapped in the tokenizer and the tokens."""
    permutation = np.arange(VOCAB_SIZE)
    permutation[[EOS_ID, eos_id, PAD_ID, pad_id]] = [eos_id, EOS_ID, pad_id, PAD_ID]
    tokenizer = json.loads(corpus.tokenizer_json)
    tokenizer["model"]["vocab"] = {token: int(permutation[i]) for token, i in tokenizer["model"]["vocab"].items()}
    for added in tokenizer["added_tokens"]:
        added["id"] = int(permutation[added["id"]])
    docs = {key: [permutation[doc] for doc in docs] for key, docs in corpus.docs.items()}
    return Corpus(json.dumps(tokenizer), docs, pad_id=pad_id)


def test_special_token_ids_come_from_the_runs_tokenizer(make_run_dir: MakeRunDir, stdlib_corpus: Corpus,
                                                        capsys: pytest.CaptureFixture) -> None:
    settings = {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2, "eval_batches": 8}
    moved = with_special_ids_moved(stdlib_corpus, eos_id=VOCAB_SIZE - 2, pad_id=VOCAB_SIZE - 1)
    runs = {"usual": make_run_dir("usual", train=settings),
            "moved": make_run_dir("moved", train=settings, corpus=moved)}
    for run_dir in runs.values():
        assert main(["--run-dir", str(run_dir)]) == 0
    config = json.loads((runs["moved"] / "model" / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (VOCAB_SIZE - 2, VOCAB_SIZE - 1)
    # Padding is masked wherever its id is: the loss counts the same tokens under either numbering.
    val_tokens = {name: read_metric_rows(run_dir / "metrics" / "eval.jsonl")[-1]["val_tokens"]
                  for name, run_dir in runs.items()}
    assert val_tokens["moved"] == val_tokens["usual"] > 0

    # A tokenizer.json that is not the one the shards were packed with is refused before training.
    tokenizer = runs["usual"] / "tokenizer" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    edit_recipe(runs["usual"], "train", max_steps=4)
    capsys.readouterr()
    assert main(["--run-dir", str(runs["usual"])]) == 2
    assert "is not the tokenizer the shards were packed with" in capsys.readouterr().err
