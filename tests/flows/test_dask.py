"""Data stages on a Dask cluster (2 worker processes) against a real Prefect server: byte-identical outputs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.flows.conftest import write_small_recipe

pytestmark = pytest.mark.slow
COMPARED = ("docs/*.parquet", "rejects/*.parquet", "dedupe/duplicates.parquet", "dedupe/clusters.parquet",
            "tokenizer/tokenizer.json", "shards/**/*.arrow", "shards/index.parquet")
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


@pytest.fixture
def prefect_api(prefect_server: None) -> Iterator[str]:
    """The session's test server, also named in os.environ for the Dask worker processes.

    Without an API URL in their environment each worker would start its own temporary server; a second
    server in this process would leave Prefect's log and event workers bound to it after it stops.
    """
    from prefect.settings import PREFECT_API_URL

    api_url = PREFECT_API_URL.value()
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url
    try:
        yield api_url
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved


def digests(run_dir: Path) -> dict[str, str]:
    return {path.relative_to(run_dir).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for pattern in COMPARED for path in sorted(run_dir.glob(pattern))}


def test_dask_run_is_byte_identical_to_the_local_run(tmp_path: Path, prefect_api: str) -> None:
    from distributed import LocalCluster

    from flows.pipeline import prepare_on

    recipe = write_small_recipe(tmp_path, packages=("json", "email", "logging"))
    data = yaml.safe_load(recipe.read_text())
    data["data"]["part_size_bytes"] = 100_000  # several parts, so both workers ingest
    recipe.write_text(yaml.safe_dump(data))
    local = prepare_on(str(recipe), str(tmp_path / "local"))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        # As a user runs it: docs/orchestration.md's `--dask-address`, through the console script.
        result = subprocess.run([TOKENMILL, "--quiet", "prepare", str(recipe), "--run-dir", str(tmp_path / "dask"),
                                 "--dask-address", cluster.scheduler_address],
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ran_on_cluster = set(cluster.scheduler.task_prefixes)
    assert local["parts_ingested"] >= 3 and json.loads(result.stdout)["parts_ingested"] == local["parts_ingested"]
    assert "stage_task" in ran_on_cluster  # the stages' units (ingest parts, pack pairs) ran on the cluster
    local_digests, dask_digests = digests(tmp_path / "local"), digests(tmp_path / "dask")
    assert len(local_digests) > 5
    assert dask_digests == local_digests
