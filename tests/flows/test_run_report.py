"""The report at the end of every run: after prepare-data, and after a failed training run, linked from Prefect."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import ChildProcessFailed
from flows.report.artifact_keys import artifact_key
from tests.flows.conftest import Recorder, write_small_recipe

pytestmark = pytest.mark.slow


def run_summaries(run_dir: Path) -> list[str]:
    """Every version of the run's ``run-summary`` markdown artifact on the session's Prefect server."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    key = artifact_key(run_dir, "run-summary")
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return [str(artifact.data) for artifact in found]


def links(markdown: str, report: Path) -> bool:
    """The summary links the report as a file:// URL and names its plain path."""
    path = report.resolve()
    return f"]({path.as_uri()})" in markdown and f"`{path}`" in markdown


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, prefect_server: None) -> dict[str, Any]:
    """A prepared run whose training always runs past its deadline (0.12 s: the trainer cannot even start)."""
    from flows.pipeline import prepare_data

    root = tmp_path_factory.mktemp("report")
    recipe = write_small_recipe(root)
    data = yaml.safe_load(recipe.read_text())
    data["train"]["deadline_minutes"] = 0.002
    recipe.write_text(yaml.safe_dump(data))
    summary = prepare_data(str(recipe))
    report = root / "run" / "report" / "index.html"
    return {"recipe": str(recipe), "run_dir": root / "run", "report": report, "summary": summary,
            "html": report.read_text() if report.is_file() else None}


def test_prepare_writes_a_data_only_report_linked_from_the_run_summary(prepared: dict[str, Any]) -> None:
    assert prepared["summary"]["report"] == str(prepared["report"])
    assert prepared["html"] is not None and "Rejected by reason" in prepared["html"]
    assert any(links(markdown, prepared["report"]) and "Data prepared" in markdown
               for markdown in run_summaries(prepared["run_dir"]))


def test_failed_training_still_writes_the_report_and_fails_with_its_own_error(prepared: dict[str, Any]) -> None:
    from flows.pipeline import train_model

    shutil.rmtree(prepared["report"].parent)
    with pytest.raises(ChildProcessFailed, match="deadline"):
        train_model(prepared["recipe"])
    assert prepared["report"].is_file()
    assert any(links(markdown, prepared["report"]) and "Training failed" in markdown
               for markdown in run_summaries(prepared["run_dir"]))


def test_a_failing_report_does_not_hide_the_training_error(prepared: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.pipeline import train_model

    def broken_report(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise OSError("disk full")

    monkeypatch.setattr("flows.report.stage.ReportStage.run", broken_report)
    shutil.rmtree(prepared["report"].parent)  # else the report is up to date and the stage skips it
    recorder, flow_logger = Recorder(), logging.getLogger("prefect.flow_runs")
    flow_logger.addHandler(recorder)
    try:
        with pytest.raises(ChildProcessFailed, match="deadline"):
            train_model(prepared["recipe"])
    finally:
        flow_logger.removeHandler(recorder)
    assert any("Could not write the report of the failed training run" in m for m in recorder.messages)
