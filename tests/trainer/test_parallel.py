"""trainer/parallel/accelerator.py, launch.py: 2 processes via a real ``accelerate launch`` (DDP, FSDP2) = 1 process,
same math."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import warnings
from pathlib import Path

import psutil
import pytest
import torch

from core.errors import ConfigError
from core.files.atomic import sha256_file
from flows.run_sql import run_query
from pipeline.sql.query import realised_mix
from tests.trainer.conftest import MakeRunDir, edit_recipe, exported_weights, fresh_accelerator, metric_steps
from tests.trainer.test_resume import wait_for_step
from trainer.checkpoint.checkpointer import verify_checkpoint
from trainer.config import TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import PAD_ID, SplitRows
from trainer.metrics.sink import read_metric_rows
from trainer.model.llama import ModelShape, build_model
from trainer.parallel.accelerator import build_accelerator
from trainer.parallel.launch import launch_command
from trainer.train import main, read_trainer_config

REPO_ROOT = Path(__file__).resolve().parents[2]

FP32_ATOL = 2e-5
"""Largest weight difference accepted between 2 processes and 1 (fp32 sums in another order); measured: 0.0."""


def launch(run_dir: Path, num_processes: int, until_step: int | None = None) -> str:
    """Run ``accelerate launch … -m trainer.train`` as the flow does; returns its stdout."""
    completed = subprocess.run(launch_command(run_dir, num_processes, until_step), cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    return completed.stdout


def max_weight_difference(first: Path, second: Path) -> float:
    """Largest absolute difference between two exported models' weights."""
    a, b = exported_weights(first), exported_weights(second)
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def one_process_reference(make_run_dir: MakeRunDir, settings: dict[str, object], until_step: int,
                          name: str = "reference") -> Path:
    """The same global batch on 1 process: gradient accumulation doubled, trained in this process in one go."""
    reference = make_run_dir(name, train={**settings, "grad_accum_steps": 2})
    assert main(["--run-dir", str(reference), "--until-step", str(until_step)]) == 0
    return reference


@pytest.mark.slow
def test_two_processes_equal_one_with_doubled_accumulation_then_resume_on_one(
        make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture) -> None:
    settings = {"max_steps": 6, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 3}
    run_dir = make_run_dir(train={**settings, "num_processes": 2})
    assert read_trainer_config(run_dir).train.num_processes == 2  # what the flow hands to launch_command
    stdout = launch(run_dir, 2, until_step=4)
    assert "on 2 process(es), 512 tokens/step" in stdout
    checkpoint = run_dir / "checkpoints" / "step-0000004"
    assert {"random_states_0.pkl", "random_states_1.pkl", "manifest.json"} <= {p.name for p in checkpoint.iterdir()}
    assert metric_steps(run_dir, "eval.jsonl") == [0, 2, 4]

    # Data parallelism is the maths of gradient accumulation: same weights within fp32 rounding.
    reference = one_process_reference(make_run_dir, settings, until_step=4)
    difference = max_weight_difference(run_dir, reference)
    assert difference < FP32_ATOL

    # The 2-rank evaluation (gathered sums) equals a 1-process evaluation of the same weights.
    config = read_trainer_config(run_dir)
    rows = SplitRows(run_dir, "val", PAD_ID)
    model = build_model(ModelShape(config.model.resolved_dims(), rows.vocab_size, rows.seq_len), seed=1)
    model.load_state_dict(exported_weights(run_dir))
    single = Evaluator(rows, micro_batch_size=4, eval_batches=3, accelerator=fresh_accelerator()).evaluate(model)
    two_rank = read_metric_rows(run_dir / "metrics" / "eval.jsonl")[-1]
    assert single["val_loss"] == pytest.approx(two_rank["val_loss"], abs=1e-5)
    assert single["val_tokens"] == two_rank["val_tokens"] == 3 * 4 * 63

    # The same global batch on one process (grad accumulation doubled) resumes without complaint...
    edit_recipe(run_dir, "train", grad_accum_steps=2, num_processes=1)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 4" in capsys.readouterr().out
    assert metric_steps(run_dir, "train.jsonl")[-1] == 6

    # ...and ends where one process trained straight through to step 6 ends (measured: 0.0): the resume restored
    # the weights, AdamW moments, schedule and data position. A loader restarted at sample 0, or one micro-batch
    # off, ended 3e-3 away.
    straight = one_process_reference(make_run_dir, settings, until_step=6, name="straight-through")
    assert max_weight_difference(run_dir, straight) < FP32_ATOL


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_matches_one_process_and_resumes(make_run_dir: MakeRunDir,
                                                                    capsys: pytest.CaptureFixture) -> None:
    settings = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 3}
    run_dir = make_run_dir(train={**settings, "fsdp": True, "activation_checkpointing": True})
    launch(run_dir, 2, until_step=2)
    stdout = launch(run_dir, 2)  # resumes from the sharded checkpoint
    assert "Resuming from checkpoint at step 2" in stdout
    for step in (2, 4):
        folder = run_dir / "checkpoints" / f"step-{step:07d}"
        manifest = json.loads((folder / "manifest.json").read_text())["files"]
        assert {"pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp",
                "optimizer_0/.metadata"} <= set(manifest)
        assert "model.safetensors" not in manifest  # sharded: no rank holds the whole model
        assert verify_checkpoint(folder) is None

    # Sharding (and recomputing activations) changes where the maths runs, not the result.
    reference = one_process_reference(make_run_dir, settings, until_step=4)
    difference = max_weight_difference(run_dir, reference)
    assert difference < FP32_ATOL
    reference_eval = read_metric_rows(reference / "metrics" / "eval.jsonl")[-1]["val_loss"]
    assert read_metric_rows(run_dir / "metrics" / "eval.jsonl")[-1]["val_loss"] == pytest.approx(reference_eval,
                                                                                                abs=1e-4)

    # An FSDP checkpoint is refused, with the fix, by a run that is not sharded.
    edit_recipe(run_dir, "train", fsdp=False, max_steps=6)
    assert main(["--run-dir", str(run_dir)]) == 2
    assert "holds FSDP weights but this run is unsharded; set train.fsdp back to true" in capsys.readouterr().err

    # DCP reads its .metadata index with plain pickle: a planted one (its manifest entry rewritten to match)
    # makes the checkpoint invalid before anything unpickles it.
    folder = run_dir / "checkpoints" / "step-0000004"
    planted = folder / "optimizer_0" / ".metadata"
    planted.write_bytes(pickle.dumps(print))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["optimizer_0/.metadata"] = {"num_bytes": planted.stat().st_size, "sha256": sha256_file(planted)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert "refers to builtins.print, which a DCP index never holds" in str(verify_checkpoint(folder))


def test_fsdp_on_one_process_warns_that_it_has_no_effect() -> None:
    with pytest.warns(UserWarning, match=r"train\.fsdp has no effect on 1 process"):
        build_accelerator(TrainConfig(fsdp=True))


def test_deepspeed_config_is_validated_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.deepspeed_config: .*ds\.json does not exist"):
        build_accelerator(TrainConfig(deepspeed_config="ds.json"), tmp_path)
    (tmp_path / "ds.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        build_accelerator(TrainConfig(deepspeed_config="ds.json"), tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="DeepSpeed needs CUDA GPUs"):
            build_accelerator(TrainConfig(deepspeed_config=str(tmp_path / "ds.json")))
    with pytest.raises(ValueError, match="set only one of them"):
        TrainConfig(fsdp=True, deepspeed_config="ds.json")


def test_multi_node_launch_command() -> None:
    argv = launch_command(Path("runs/x"), 16, num_machines=2, machine_rank=1, main_process_ip="10.0.0.1")
    flag = {name: argv[argv.index(name) + 1] for name in ("--num_processes", "--num_machines", "--machine_rank",
                                                          "--main_process_ip", "--main_process_port")}
    assert flag == {"--num_processes": "16", "--num_machines": "2", "--machine_rank": "1",
                    "--main_process_ip": "10.0.0.1", "--main_process_port": "29500"}
    assert "--multi_gpu" in argv and argv[-4:] == ["-m", "trainer.train", "--run-dir", "runs/x"]
    assert "--machine_rank" not in launch_command(Path("runs/x"), 2)  # one machine: the flags stay as they were
    with pytest.raises(ValueError, match="main_process_ip"):
        launch_command(Path("runs/x"), 16, num_machines=2)


@pytest.mark.slow
def test_kill_9_right_after_a_mixture_stage_boundary_on_two_processes_then_resume_on_one(
        make_run_dir: MakeRunDir, tmp_path: Path) -> None:
    """A ``mixture_schedule`` run on 2 processes is SIGKILLed in the first step of its second stage; resumed on 1
    process (grad accumulation doubled) it ends bitwise where 1 process trained straight through ends, and the
    source dropped by ``max_repetition`` at that boundary is dropped in both."""
    settings = {"max_steps": 6, "checkpoint_every": 3, "log_every": 1, "eval_every": 100, "eval_batches": 1,
                "peak_tflops": 1.0, "tensorboard": False}  # no MFU probe, no event files: the test is about the data
    web_rows = len(SplitRows(make_run_dir("sizes"), "train", PAD_ID).rows_by_source()["web"])
    # web may be seen 500 samples: stage 0 (256 web per block) keeps it, stage 1 (768 per block) drops it at step 4.
    schedule = {"stages": [{"until_step": 3, "weights": {"email": 3, "web": 1}},
                           {"weights": {"email": 1, "web": 3}}], "max_repetition": {"web": 500 / web_rows}}
    run_dir = make_run_dir(train={**settings, "num_processes": 2})
    edit_recipe(run_dir, "mixture_schedule", **schedule)
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(launch_command(run_dir, 2), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_for_step(run_dir, 4, process, timeout_s=240)  # step 4: the first of stage 1, web just dropped
    finally:  # the launcher and its ranks (each rank may run in a session of its own), as a machine going down
        ranks = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.kill()
        psutil.wait_procs(ranks, timeout=60)
    assert process.wait(timeout=60) == -signal.SIGKILL, log.read_text()[-2000:]
    assert "'web' dropped from the mix at step 4" in log.read_text()
    assert not (run_dir / "model" / "model.safetensors").exists()

    edit_recipe(run_dir, "train", grad_accum_steps=2, num_processes=1)
    with pytest.warns(UserWarning, match="'web' dropped from the mix at step 4"):  # re-decided after the resume
        assert main(["--run-dir", str(run_dir)]) == 0
    assert read_metric_rows(run_dir / "metrics" / "train.jsonl")[-1]["step"] == 6
    straight = make_run_dir("straight", train={**settings, "grad_accum_steps": 2})
    edit_recipe(straight, "mixture_schedule", **schedule)
    with pytest.warns(UserWarning, match="'web' dropped"):
        assert main(["--run-dir", str(straight)]) == 0
    resumed, expected = exported_weights(run_dir), exported_weights(straight)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected), "weights differ"
    # The realised mix, from the rows of both the killed and the resumed run: 3 steps of 8 samples per stage.
    mix = {(row["stage"], row["source"]): row["samples"] for row in realised_mix(run_dir)}
    assert mix[(0, "email")] + mix[(0, "web")] == 24 and mix.get((1, "web"), 0) == 0 and mix[(1, "email")] == 24
    assert realised_mix(run_dir) == realised_mix(straight)
    # consumed replays the two launches' scheduled order (2 processes, then 1 from step 3's checkpoint): the rows of
    # the straight run, step for step, and per stage and source the samples the trainer counted.
    sql = "SELECT step, sample, shard_path, row_in_shard FROM consumed ORDER BY sample"
    assert run_query(run_dir, sql) == run_query(straight, sql)
    per_stage = run_query(run_dir, "SELECT (step > 3)::INT AS stage, source, count(*) AS n FROM consumed GROUP BY ALL")
    assert {(row["stage"], row["source"]): row["n"] for row in per_stage.to_pylist()} == {
        key: samples for key, samples in mix.items() if samples}
