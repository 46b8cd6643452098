"""What the Prefect UI shows of a run, read back from a real Prefect server: the task graph's edges, and
artifacts that carry the run's own tables under keys of their own."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from flows.report.artifact_keys import artifact_key
from pipeline.shard_stats import shard_stats
from pipeline.sql.query import data_funnel
from tests.flows.conftest import write_small_recipe

pytestmark = pytest.mark.slow

TASKS = ("ingest", "dedupe", "eval-tasks", "decontaminate", "tokenizer", "pack", "shard-index", "report")
"""prepare-data's stages; a task run is named after its stage and unit (``dedupe``, ``pack train/stdlib``)."""
EDGES = {("ingest", "dedupe"), ("ingest", "eval-tasks"), ("dedupe", "eval-tasks"),
         ("ingest", "decontaminate"), ("dedupe", "decontaminate"), ("eval-tasks", "decontaminate"),
         ("ingest", "tokenizer"), ("dedupe", "tokenizer"), ("decontaminate", "tokenizer"),
         ("ingest", "pack"), ("dedupe", "pack"), ("decontaminate", "pack"), ("tokenizer", "pack"),
         ("pack", "shard-index"),
         *(("ingest", "report"), ("dedupe", "report"), ("eval-tasks", "report"), ("decontaminate", "report"),
           ("tokenizer", "report"), ("pack", "report"), ("shard-index", "report"))}
"""The data path as Prefect must draw it: an edge from each stage whose files a stage reads (its ``reads``)."""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, prefect_server: None) -> dict[str, Any]:
    """Two runs on one server: ``alpha`` with an undecodable file (one reject), ``Beta_Run.v2`` without rejects."""
    from prefect.events.worker import EventsWorker

    from flows.pipeline import prepare_data
    from flows.recipe import resolve_run

    EventsWorker.drain_all()  # task runs reach the server as events: through a worker started for this server
    runs = {}
    for name, broken in (("alpha", True), ("Beta_Run.v2", False)):
        root = tmp_path_factory.mktemp(name)
        recipe = write_small_recipe(root, packages=("json",))
        if broken:
            (root / "corpus" / "json" / "latin1.py").write_bytes(b"# caf\xe9 = 1\n")
        # alpha as a deployment starts it (a path), beta as the commands do (the run they resolved once)
        state = (prepare_data(str(recipe), str(root / name), return_state=True) if broken
                 else prepare_data(resolve_run(recipe, root / name), return_state=True))
        runs[name] = {"run_dir": root / name, "summary": state.result(),
                      "flow_run_id": state.state_details.flow_run_id}
    return runs


def task_runs(flow_run_id: Any, expected: int) -> list[Any]:
    """The flow run's task runs, once the server recorded ``expected`` of them (task runs arrive as events)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        for _ in range(120):
            found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if len(found) >= expected and all(run.state is not None and run.state.is_final() for run in found):
                return found
            time.sleep(0.5)
    raise AssertionError(f"the server recorded {len(found)} of {expected} task runs")


def task_of(task_run_name: str) -> str:
    return task_run_name.split(" ")[0]


def test_every_stage_is_connected_to_the_stage_it_reads_from(prepared: dict[str, Any]) -> None:
    run = prepared["alpha"]
    # the parts, dedupe, eval-tasks, decontaminate, tokenizer, pack (train, val), shard-index, report
    expected = run["summary"]["parts_ingested"] + 4 + 2 + 2
    found = task_runs(run["flow_run_id"], expected)
    parts = [f"ingest part-{number:05d}" for number in range(run["summary"]["parts_ingested"])]
    assert sorted(task_run.name for task_run in found) == sorted([  # the stage's name and unit: no random suffix
        *parts, "dedupe", "eval-tasks", "decontaminate", "tokenizer", "pack train/stdlib", "pack val/stdlib",
        "shard-index", "report"])
    names = {task_run.id: task_of(task_run.name) for task_run in found}
    assert set(names.values()) == set(TASKS)
    edges = {(names[upstream.id], names[task_run.id]) for task_run in found
             for inputs in task_run.task_inputs.values() for upstream in inputs
             if getattr(upstream, "input_type", None) == "task_run" and upstream.id in names}
    assert edges == EDGES, f"missing: {sorted(EDGES - edges)}, unexpected: {sorted(edges - EDGES)}"
    unconnected = {names[task_run.id] for task_run in found} - {task for edge in edges for task in edge}
    assert unconnected == set()


def test_a_flow_run_shows_the_recipe_readably_not_the_resolved_run(prepared: dict[str, Any]) -> None:
    from prefect import get_client

    runs = {}
    with get_client(sync_client=True) as client:
        for name, run in prepared.items():
            runs[name] = client.read_flow_run(run["flow_run_id"]).parameters
    assert runs["alpha"]["recipe"].endswith("recipe.yaml")  # a path stays a path
    shown = runs["Beta_Run.v2"]["recipe"]
    assert shown["recipe"] == "slice" and shown["run_dir"] == str(prepared["Beta_Run.v2"]["run_dir"])
    assert shown["settings"]["tokenizer"] == {"vocab_size": 512}  # what the recipe sets, defaults left out
    assert len(json.dumps(runs["Beta_Run.v2"])) < 1000


def latest_artifact(key: str) -> Any:
    """The data of the newest artifact under ``key`` (a table's JSON text, a markdown text), or None."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key])))
    return found[0].data if found else None


def latest_table(key: str) -> list[dict[str, Any]]:
    data = latest_artifact(key)
    assert data is not None, f"no artifact {key}"
    return json.loads(data) if isinstance(data, str) else data


def test_rejects_by_reason_is_published_when_nothing_was_rejected(prepared: dict[str, Any]) -> None:
    alpha, beta = prepared["alpha"]["run_dir"], prepared["Beta_Run.v2"]["run_dir"]
    assert latest_table(artifact_key(beta, "rejects-by-reason")) == [
        {"source": "stdlib", "reason": "(none)", "records": 0, "meaning": "no record was rejected"}]
    rejects = latest_table(artifact_key(alpha, "rejects-by-reason"))
    assert [(row["source"], row["reason"], row["records"]) for row in rejects] == [("stdlib", "invalid_utf8", 1)]


def test_shard_stats_artifact_is_the_stats_table(prepared: dict[str, Any]) -> None:
    run_dir = prepared["alpha"]["run_dir"]
    rows = latest_table(artifact_key(run_dir, "shard-stats"))
    assert rows == json.loads(json.dumps(shard_stats(run_dir)))
    assert {row["split"] for row in rows} == {"train", "val"} and all(row["num_tokens"] > 0 for row in rows)


def test_each_run_keeps_its_own_artifacts(prepared: dict[str, Any]) -> None:
    keys = set()
    for run in prepared.values():
        run_dir = run["run_dir"]
        funnel = latest_table(artifact_key(run_dir, "data-funnel"))
        assert funnel == data_funnel(run_dir)
        summary = latest_artifact(artifact_key(run_dir, "run-summary"))
        assert f"# tokenmill run `{run_dir.name}`" in summary
        keys.add(artifact_key(run_dir, "data-funnel"))
    assert keys == {"alpha-data-funnel", "beta-run-v2-data-funnel"}
    assert [row["rejected"] for row in latest_table("alpha-data-funnel")] == [1]
    assert [row["rejected"] for row in latest_table("beta-run-v2-data-funnel")] == [0]
