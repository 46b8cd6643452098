"""The full evaluation of checkpoints (trainer/eval/checkpoint.py, plan.py, core/eval_results.py).

On a real trained run dir: the whole val split is scored (every row), per source, in bits per byte, and the
numbers equal an independent computation with ``transformers`` on the export and the tokenizer's own decoding;
2 processes under a real ``accelerate launch`` give the numbers 1 process gives; results are cached by the
checkpoint's and the task's fingerprints; a checkpoint that fails its manifest check is a recorded failure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from core.eval_results import VAL_SPLIT_TASK, all_rows, read_result
from core.rundir import RunPaths
from flows.run_sql import run_query
from tests.trainer.conftest import MakeRunDir, edit_recipe, fresh_accelerator
from trainer.checkpoint.layout import chosen_checkpoints
from trainer.eval.checkpoint import evaluate_checkpoint, val_split_task_fingerprint
from trainer.eval.evaluate import Evaluator, bits_per_byte
from trainer.eval.plan import plan_evaluation
from trainer.loader.batches import PAD_ID, SplitRows, make_batch
from trainer.model.llama import IGNORE_INDEX, ModelShape, build_model
from trainer.parallel.launch import eval_launch_command
from trainer.train import main as train_main
from trainer.train import read_trainer_config

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def trained_run(make_run_dir: MakeRunDir) -> Path:
    """8 steps, checkpoints at 4 and 8 (two sources: email and web), exported."""
    run_dir = make_run_dir()
    assert train_main(["--run-dir", str(run_dir)]) == 0
    return run_dir


def val_split_scores(run_dir: Path, step: int) -> dict[tuple[str, str | None], float]:
    result = read_result(RunPaths(run_dir).eval_result(step, VAL_SPLIT_TASK))
    assert result is not None and result["status"] == "ok", result
    return {(row["metric"], row["source"]): row["value"] for row in result["rows"]}


def transformers_scores(run_dir: Path) -> dict[tuple[str, str | None], float]:
    """Loss and bits per byte over every val row, from the export loaded by transformers and the tokenizer's
    own decoding: an oracle that shares no code with the evaluator but the shard reader."""
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(run_dir / "tokenizer" / "tokenizer.json"))
    rows = SplitRows(run_dir, "val", PAD_ID)
    totals: dict[str | None, list[float]] = {}
    for source, row_ids in rows.rows_by_source().items():
        batch = make_batch(rows.rows(row_ids), PAD_ID)
        with torch.no_grad():
            logits = model(batch.input_ids).logits.double()
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   batch.labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX,
                                                   reduction="sum").item()
        tokens = int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
        texts = tokenizer.decode_batch([row[row != IGNORE_INDEX].tolist() for row in batch.labels[:, 1:].numpy()],
                                       skip_special_tokens=True)
        num_bytes = sum(len(text.encode("utf-8")) for text in texts)
        for key in (source, None):
            total = totals.setdefault(key, [0.0, 0, 0])
            total[0] += losses
            total[1] += tokens
            total[2] += num_bytes
    scores = {}
    for key, (loss_sum, tokens, num_bytes) in totals.items():
        scores[("loss", key)] = loss_sum / tokens
        scores[("bits_per_byte", key)] = loss_sum / math.log(2) / num_bytes
    scores[("tokens", None)], scores[("bytes", None)] = totals[None][1], totals[None][2]
    return scores


@pytest.mark.slow
def test_whole_split_scores_equal_transformers_and_do_not_depend_on_the_process_count(trained_run: Path) -> None:
    evaluate_checkpoint(trained_run, 8, score=True, export=False)
    one = val_split_scores(trained_run, 8)
    oracle = transformers_scores(trained_run)
    print({key: (round(one[key], 5), round(oracle[key], 5)) for key in oracle})
    for key, expected in oracle.items():
        assert one[key] == pytest.approx(expected, rel=1e-5), key
    assert one[("perplexity", None)] == pytest.approx(math.exp(one[("loss", None)]))
    val_rows = SplitRows(trained_run, "val", PAD_ID).num_rows
    result = read_result(RunPaths(trained_run).eval_result(8, VAL_SPLIT_TASK))
    assert {row["num_samples"] for row in result["rows"] if row["source"] is None} == {val_rows}, \
        "every val row is scored, not the in-loop subset"
    assert {source for _, source in one} == {None, "email", "web"}

    completed = subprocess.run(eval_launch_command(trained_run, 2, 8, score=True, export=False), cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    two = val_split_scores(trained_run, 8)
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_whole_split_reports_rows_scored_as_it_goes(make_run_dir: MakeRunDir) -> None:
    # The whole-split evaluation of the quick start ran 4 minutes with no line and no bar.
    run_dir = make_run_dir()
    config = read_trainer_config(run_dir)
    rows = SplitRows(run_dir, "val", PAD_ID)
    model = build_model(ModelShape(config.model.resolved_dims(), rows.vocab_size, rows.seq_len), seed=1)
    evaluator = Evaluator(rows, micro_batch_size=2, eval_batches=None, accelerator=fresh_accelerator())
    reports: list[tuple[int, int]] = []
    scores = evaluator.evaluate(model, on_progress=lambda done, total: reports.append((done, total)))
    assert len(reports) == evaluator.num_forwards > 2, "one report per forward"
    assert {total for _, total in reports} == {rows.num_rows} and reports[-1] == (rows.num_rows, rows.num_rows)
    assert [done for done, _ in reports] == sorted(done for done, _ in reports) and reports[0][0] > 0
    assert scores == evaluator.evaluate(model), "reporting changes no score"


def test_bits_per_byte_is_nats_over_bytes_in_bits() -> None:
    assert bits_per_byte(math.log(2) * 100, 50) == pytest.approx(2.0)
    assert math.isnan(bits_per_byte(1.0, 0))


@pytest.mark.slow
def test_results_are_cached_by_fingerprint_and_a_corrupt_checkpoint_is_a_recorded_failure(trained_run: Path) -> None:
    paths = RunPaths(trained_run)
    val_fp = val_split_task_fingerprint(paths, "fp32")
    checkpoints = chosen_checkpoints(paths, "all")
    assert [step for step, _ in checkpoints] == [4, 8]
    plans = plan_evaluation(paths, checkpoints, val_fp, {})
    assert [(plan.step, plan.score_val_split) for plan in plans] == [(4, True), (8, True)]
    evaluate_checkpoint(trained_run, 4, score=True, export=False)
    assert [plan.step for plan in plan_evaluation(paths, checkpoints, val_fp, {})] == [8], "step 4 is done"
    assert [plan.step for plan in plan_evaluation(paths, checkpoints, "another task fingerprint", {})] == [4, 8]

    weights = checkpoints[1][1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"flipped!")
    assert [plan.step for plan in plan_evaluation(paths, checkpoints, val_fp, {})] == []
    failed = read_result(paths.eval_result(8, VAL_SPLIT_TASK))
    assert failed["status"] == "failed" and "step-0000008" in failed["error"]
    assert "model.safetensors does not match its sha256" in failed["error"] and "\n" not in failed["error"]
    assert read_result(paths.eval_result(4, VAL_SPLIT_TASK))["status"] == "ok", "a finished result is kept"
    rows = run_query(trained_run, "SELECT step, task, metric, source, value FROM eval_results "
                                  "WHERE metric = 'bits_per_byte' ORDER BY source NULLS FIRST").to_pylist()
    assert [(row["step"], row["task"], row["source"]) for row in rows] == [
        (4, "val_split", None), (4, "val_split", "email"), (4, "val_split", "web")]
    assert rows == [row for row in (dict(step=r["step"], task=r["task"], metric=r["metric"], source=r["source"],
                                         value=r["value"]) for r in all_rows(paths)) if row["metric"] ==
                    "bits_per_byte"], "the view serves the stored rows"


@pytest.mark.slow
def test_eval_command_killed_mid_evaluation_finishes_with_the_rows_of_an_uninterrupted_run(
        trained_run: Path, tmp_path: Path) -> None:
    """``tokenmill eval RUN --checkpoint all`` killed (-9) once the first checkpoint's result exists, re-run."""
    edit_recipe(trained_run, "tokenizer", vocab_size=512)  # run.yaml as the flow records it: a complete recipe
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(trained_run, uninterrupted)
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    command = [str(Path(sys.executable).parent / "tokenmill"), "eval", str(trained_run), "--checkpoint", "all"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    first = RunPaths(trained_run).eval_result(4, VAL_SPLIT_TASK)
    deadline = time.monotonic() + 400
    while not first.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.is_file(), process.stderr.read().decode()[-2000:] if process.poll() is not None else "timed out"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    finished_before = first.read_bytes()
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    for step in (4, 8):  # the uninterrupted reference: what the command's launched processes run, in one go
        evaluate_checkpoint(uninterrupted, step, score=True, export=False)
    assert first.read_bytes() == finished_before, "the finished result was kept, not recomputed"
    summary = json.loads(completed.stdout[completed.stdout.index("{"):])
    assert summary["failed"] == [] and summary["results"]
    interrupted_rows, clean_rows = all_rows(RunPaths(trained_run)), all_rows(RunPaths(uninterrupted))
    assert {row["step"] for row in clean_rows} == {4, 8}
    assert [{**row, "value": round(row["value"], 9)} for row in interrupted_rows] == \
        [{**row, "value": round(row["value"], 9)} for row in clean_rows]
    assert np.isfinite([row["value"] for row in clean_rows]).all()
