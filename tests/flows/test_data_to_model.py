"""The whole flow on a slice of the standard library, through a real Prefect server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.numbers import rounded_floats
from core.rundir import RunPaths
from core.shards.store import verify_shards
from core.stage import read_marker, stage_status
from flows.recipe import resolve_recorded_run
from flows.report.artifact_keys import artifact_key
from flows.report.stage import report_inputs_fingerprint
from flows.run_sql import run_query
from tests.flows.conftest import write_small_recipe
from trainer.train_stage import TrainStage

pytestmark = pytest.mark.slow
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: None) -> tuple[Path, dict, dict]:
    from flows.pipeline import data_to_model

    root = tmp_path_factory.mktemp("flow")
    recipe = write_small_recipe(root, evaluate={"tasks": ["tokenmill_next_line"], "next_line_items": 40})
    first = data_to_model(str(recipe))
    second = data_to_model(str(recipe))
    return root / "run", first, second


def test_every_stage_leaves_its_artifacts(finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, first, _ = finished_run
    for relpath in ("run.yaml", "tokenizer/tokenizer.json", "shards/index.parquet",
                    "metrics/train.jsonl", "metrics/eval.jsonl",
                    "model/config.json", "model/model.safetensors", "model/tokenizer.json"):
        assert (run_dir / relpath).is_file(), relpath
    assert list(run_dir.glob("docs/part-*.parquet")) and list(run_dir.glob("checkpoints/step-*"))
    assert verify_shards(run_dir) == []
    assert first["prepare"]["num_tokens"] > 10_000


def test_the_full_evaluation_runs_after_training_and_a_rerun_recomputes_nothing(
        finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, first, second = finished_run
    for relpath in ("eval/tasks/tokenmill_next_line.yaml", "eval/tasks/tokenmill_next_line.jsonl",
                    "eval/texts/tokenmill_next_line.jsonl", "eval/results/step-0000030/val_split.json",
                    "eval/results/step-0000030/tokenmill_next_line.json"):
        assert (run_dir / relpath).is_file(), relpath
    rows = {(row["task"], row["metric"]): row for row in first["train"]["eval"]["results"]}
    assert rows[("tokenmill_next_line", "acc")]["num_samples"] == 40
    assert rows[("val_split", "bits_per_byte")]["num_samples"] == run_query(
        run_dir, "SELECT sum(num_rows) AS n FROM shards WHERE split = 'val'").to_pylist()[0]["n"]
    assert second["train"]["eval"]["results"] == first["train"]["eval"]["results"]
    assert first["prepare"]["eval_tasks"]["tasks"].keys() == {"tokenmill_next_line"}
    # The recipe leaves dedupe.decontaminate off, and the summary says so: the stage still ran, against the
    # task's items only, and counts what they removed as eval_tasks.
    decontaminated = first["prepare"]["decontaminate"]
    assert not decontaminated["enabled"] and decontaminated["num_reference_ngrams"] > 0
    assert decontaminated["eval_tasks"] == decontaminated["num_contaminated"]
    assert decontaminated["contaminated_by_reference"]["val"] == 0


def test_training_progress_artifact_follows_the_metrics_file(finished_run: tuple[Path, dict, dict]) -> None:
    # The artifact follows metrics/train.jsonl as the real trainer writes it (flows/progress/training.py).
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    key = artifact_key(finished_run[0], "training-progress")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found and found[0].type == "progress"
    assert max(float(artifact.data) for artifact in found) == 100.0


def test_run_summary_artifact_links_the_report(finished_run: tuple[Path, dict, dict]) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    run_dir, first, _ = finished_run
    report = (run_dir / "report" / "index.html").resolve()
    assert first["train"]["report"] == first["prepare"]["report"] == str(run_dir / "report" / "index.html")
    assert report.is_file() and (run_dir / "report" / "throughput.png").is_file()
    key = artifact_key(run_dir, "run-summary")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    trained = [str(a.data) for a in found if "validation loss" in str(a.data) and f"`{report}`" in str(a.data)]
    assert trained and f"]({report.as_uri()})" in trained[0]


def test_validation_loss_falls(finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, first, _ = finished_run
    evals = [json.loads(line) for line in (run_dir / "metrics/eval.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert first["train"]["val_loss_subset"]["final"] == pytest.approx(evals[-1]["val_loss"], rel=1e-3)


def test_the_final_val_loss_is_the_whole_splits_everywhere(finished_run: tuple[Path, dict, dict]) -> None:
    """One name, one meaning: the summary's final_val_loss is the full evaluation's (as the report's headline),
    the in-loop subset's is val_loss_subset; the run-summary artifact, written after the evaluation, says both."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    run_dir, first, _ = finished_run
    (whole,) = run_query(run_dir, "SELECT value FROM eval_results WHERE task = 'val_split' AND metric = 'loss' "
                                  "AND source IS NULL AND step = 30").column(0).to_pylist()
    subset = json.loads((run_dir / "metrics/eval.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert abs(whole - subset) > 1e-3, "the whole split and the subset must differ for this test to mean anything"
    assert first["train"]["final_val_loss"] == pytest.approx(whole, rel=1e-3)
    assert first["train"]["final_val_loss_step"] == 30
    assert first["train"]["val_loss_subset"]["final"] == pytest.approx(subset, rel=1e-3)
    key = artifact_key(run_dir, "run-summary")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    summaries = [str(artifact.data) for artifact in found if "whole val split" in str(artifact.data)]
    assert summaries and f"**{whole:.4g}** (step 30)" in summaries[0] and f"{subset:.4g} (step 30)" in summaries[0]


def test_second_run_skips_finished_stages(finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, first, second = finished_run
    assert second["prepare"]["parts_ingested"] == 0
    for stage in ("dedupe", "decontaminate", "tokenizer", "eval_tasks"):  # each logs "skipped (up to date)"
        assert second["prepare"][stage].get("skipped") is True, stage
        assert first["prepare"][stage].get("skipped") is not True, stage
    assert second["prepare"]["num_shards"] == first["prepare"]["num_shards"]
    eval_steps = [json.loads(line)["step"] for line in (run_dir / "metrics/eval.jsonl").read_text().splitlines()]
    assert len(eval_steps) == len(set(eval_steps)), "a finished training run must not train again"
    paths = RunPaths(run_dir)  # and the next run does not even launch the trainer, nor re-render the report
    assert read_marker(paths, "train")["summary"] == {"step": 30}
    assert stage_status(TrainStage.build(resolve_recorded_run(run_dir))).state == "done"
    assert paths.done_summary("report", report_inputs_fingerprint(paths)) is not None


def test_every_record_is_accounted_for(finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, _, _ = finished_run
    corpus_files = len(list((run_dir.parent / "corpus").rglob("*.py")))
    counts = run_query(run_dir, "SELECT (SELECT count(*) FROM documents) AS d, (SELECT count(*) FROM duplicates) "
                                "AS u, (SELECT count(*) FROM rejects) AS r").to_pylist()[0]
    assert counts["d"] + counts["u"] + counts["r"] == corpus_files


def test_no_absolute_paths_in_run_dir(finished_run: tuple[Path, dict, dict]) -> None:
    run_dir, _, _ = finished_run
    uris = run_query(run_dir, "SELECT uri FROM documents UNION ALL SELECT path FROM shards").column(0).to_pylist()
    assert uris and not any(uri.startswith("/") for uri in uris)
    assert str(run_dir.parent) not in (run_dir / "run.yaml").read_text()


def test_report_headline_reads_the_finished_run(finished_run: tuple[Path, dict, dict]) -> None:
    import html

    import numpy as np
    import pyarrow.ipc as ipc

    from flows.stage_times import stage_wall_times
    from trainer.model.sample_generation import read_sample

    run_dir, _, _ = finished_run
    paths = RunPaths(run_dir)
    page = (run_dir / "report" / "index.html").read_text()
    headline = page[:page.index("<h2>Data funnel</h2>")]
    full = {row["metric"]: row["value"] for row in run_query(
        run_dir, "SELECT metric, value FROM eval_results WHERE task = 'val_split' AND source IS NULL AND step = 30"
    ).to_pylist()}
    for label, metric in (("final val loss", "loss"), ("bits per byte", "bits_per_byte")):
        assert (f'<div class="label">{label}</div><div class="value">{full[metric]:.4f}</div>'
                '<div class="note">whole val split, step 30</div>') in headline, label
    stages = {row["stage"] for row in stage_wall_times(paths)}
    assert {"ingest", "dedupe", "decontaminate", "tokenizer", "pack", "shard-index", "train", "evaluate"} <= stages
    assert all(f"<td>{stage}</td>" in headline for stage in stages)
    sample = read_sample(paths)  # made from this export, shown as it was recorded
    assert sample is not None and sample["completion"] and "error" not in sample
    assert f"<b>{html.escape(sample['prompt'])}</b>{html.escape(sample['completion'])}" in headline
    used: set[int] = set()
    for shard in run_dir.glob("shards/split=train/**/*.arrow"):
        table = ipc.open_file(str(shard)).read_all()
        ids = np.asarray(table.column("input_ids").combine_chunks().flatten()).reshape(table.num_rows, -1)
        real = np.arange(ids.shape[1]) < table.column("num_tokens").to_numpy()[:, None]
        used |= set(np.unique(ids[real]).tolist())
    assert f"{len(used):,} of 512 ids in the train rows" in headline


def run_tokenmill(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The console script, on the session's Prefect server, from ``cwd``."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    return subprocess.run([TOKENMILL, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)


def test_a_copied_run_dir_names_no_path_of_the_original_and_works_without_it(
        finished_run: tuple[Path, dict, dict], tmp_path: Path) -> None:
    """docs/architecture.md: no absolute paths, a copied run dir works. Copy the finished run, hide the original,
    and every file of the copy is free of the original's path; the read-only commands, the `lm_eval` command
    (from the run dir, as the task YAML says) and a re-run of the flow work on the copy, the re-run up to date.
    A resumed training on the copy was checked once (30 -> 32 steps) and left out: ~1 min of CI for files the
    scan above already shows free of paths."""
    from flows.pipeline import data_to_model

    run_dir, first, _ = finished_run
    copy = tmp_path / "elsewhere" / "copied-run"
    shutil.copytree(run_dir, copy, symlinks=True)
    hidden = run_dir.with_name("hidden-original")
    run_dir.rename(hidden)
    try:
        results_before = {path.name: path.read_bytes() for path in (copy / "eval/results").rglob("*.json")}
        original = [str(run_dir).encode(), str(run_dir.resolve()).encode()]
        holding = [path.relative_to(copy).as_posix() for path in sorted(copy.rglob("*"))
                   if path.is_file() and any(name in path.read_bytes() for name in original)]
        assert holding == [], f"files of the copy naming the original run dir {run_dir}"
        for command in (["query", copy, "SELECT count(*) AS n FROM documents"], ["shards", "verify", copy],
                        ["shards", "stats", copy], ["shards", "sample", copy, "--n", "2"], ["report", copy],
                        ["generate", copy, "def ", "--max-new-tokens", "5"], ["eval", copy, "--checkpoint", "last"]):
            done = run_tokenmill(*command, cwd=tmp_path)
            assert done.returncode == 0, (command, done.stderr[-2000:])
        yaml_text = (copy / "eval/tasks/tokenmill_next_line.yaml").read_text()
        assert "cd RUN_DIR && lm_eval --include_path eval/tasks" in yaml_text
        lm_eval = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={copy / 'model'}",
             "--tasks", "tokenmill_next_line", "--include_path", "eval/tasks", "--device", "cpu", "--limit", "8"],
            cwd=copy, capture_output=True, text=True, timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
        assert lm_eval.returncode == 0 and "tokenmill_next_line" in lm_eval.stdout, lm_eval.stderr[-3000:]
        again = data_to_model(str(run_dir.parent / "recipe.yaml"), str(copy))
    finally:
        hidden.rename(run_dir)
    for stage in ("dedupe", "decontaminate", "tokenizer", "eval_tasks"):
        assert again["prepare"][stage].get("skipped") is True, stage
    assert again["train"]["eval"]["results"] == first["train"]["eval"]["results"]
    assert {path.name: path.read_bytes() for path in (copy / "eval/results").rglob("*.json")} == results_before, \
        "the copy's cached results were computed again"


def test_the_evaluation_units_wait_for_training_in_the_graph(finished_run: tuple[Path, dict, dict]) -> None:
    """train-model draws its edges: each evaluation unit's task run records the train task run it waited for."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # task runs reach the server as events
    with get_client(sync_client=True) as client:
        def named(*names: str) -> list:
            return client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=list(names))))

        trains = {run.id for run in named("train")}
        units = named("evaluate step 30", "downstream-tokenmill_next_line-step-30")
        downstream = [run for run in units if run.name.startswith("downstream-")]
        exports = {run.id for run in named("export step 30")}
    assert trains and len(units) >= 2 and downstream
    for run in units:
        waited = {upstream.id for inputs in run.task_inputs.values() for upstream in inputs}
        assert waited & (trains | exports), f"{run.name} has no edge from train or export: {run.task_inputs}"
    for run in downstream:
        assert {upstream.id for inputs in run.task_inputs.values() for upstream in inputs} & exports, run.name


def test_the_downstream_result_is_logged_on_its_task_run_in_four_significant_digits(
        finished_run: tuple[Path, dict, dict]) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        logs, page = [], client.read_logs(limit=200)
        while page:  # every log line of the session's server
            logs += page
            page = client.read_logs(limit=200, offset=len(logs))
        lines = [log for log in logs if log.message.startswith("tokenmill_next_line @ step 30: ")]
        assert lines, "the downstream result was not logged"
        for log in lines:
            assert log.task_run_id is not None, "logged on the flow run, not on the downstream task's run"
            assert client.read_task_run(log.task_run_id).name.startswith("downstream-tokenmill_next_line-")
            numbers = json.loads(log.message.split(": ", 1)[1])
            assert numbers and all(value == float(f"{value:.4g}") for value in numbers.values()), log.message


def test_eval_on_a_terminal_shows_its_own_bars_and_no_other_librarys(finished_run: tuple[Path, dict, dict]) -> None:
    # Last: it recomputes the results of step 30 (to the same numbers). The whole-split evaluation ran minutes
    # without a bar; lm-eval's "Running loglikelihood requests" lines scrolled above tokenmill's bars.
    from tests.flows.test_cli import TOKENMILL
    from tests.flows.test_progress import ANSI, cli_env_for, run_in_pty

    run_dir, first, _ = finished_run
    for result in (run_dir / "eval" / "results" / "step-0000030").glob("*.json"):
        result.unlink()
    status, screen, stdout = run_in_pty([TOKENMILL, "eval", str(run_dir), "--checkpoint", "last"], cli_env_for())
    text = ANSI.sub("", screen)
    assert status == 0, text[-3000:]
    assert json.loads(stdout)["results"] == rounded_floats(first["train"]["eval"]["results"])  # as printed
    lines = text.splitlines()
    assert any(line.startswith("evaluate step 30 ") and " rows" in line for line in lines), text[-3000:]
    assert any(line.startswith("tokenmill_next_line step 30 ") and " requests" in line for line in lines)
    assert "val_split @ step 30: " in text and "tokenmill_next_line @ step 30: " in text  # the finishing lines
    for foreign in ("Running loglikelihood", "Tokenizing inputs", "Loading weights", "Generating ", "it/s]",
                    "tokenmill-progress"):
        assert foreign not in text, foreign
