"""flows.report.artifacts and flows.report.artifact_keys: keys Prefect accepts, one per run, and tables that say
"none"."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.client.schemas.actions import ArtifactCreate

from flows.report.artifact_keys import artifact_key, run_key_prefix
from flows.report.artifacts import NO_REJECTS, rejects_table


@pytest.mark.parametrize(("run_dir", "prefix"), [
    ("runs/tiny", "tiny"), ("/data/runs/My_Run.v2", "my-run-v2"), ("runs/--x__", "x"), ("runs/___", "run"),
    ("runs/Ünï côdé", "n-c-d"), ("runs/a..b", "a-b"),
])
def test_a_run_dir_name_becomes_a_key_prefix_prefect_accepts(run_dir: str, prefix: str) -> None:
    assert run_key_prefix(Path(run_dir)) == prefix
    key = artifact_key(run_dir, "data-funnel")
    assert key == f"{prefix}-data-funnel"
    assert ArtifactCreate(key=key, type="table", data="[]").key == key  # Prefect's own validation


def test_two_run_dirs_get_two_keys() -> None:
    assert artifact_key("runs/tiny", "run-summary") != artifact_key("runs/tiny-2", "run-summary")


def test_rejects_table_names_every_source_even_without_rejects() -> None:
    funnel = [{"source": "code"}, {"source": "web"}]
    rejects = [{"source": "web", "reason": "invalid_json", "records": 3}]
    assert rejects_table(funnel, rejects) == [
        {"source": "code", "reason": NO_REJECTS, "records": 0, "meaning": "no record was rejected"},
        {"source": "web", "reason": "invalid_json", "records": 3, "meaning": "the line is not valid JSON"}]
    assert rejects_table([], []) == [{"source": NO_REJECTS, "reason": NO_REJECTS, "records": 0,
                                      "meaning": "no record was read yet"}]
