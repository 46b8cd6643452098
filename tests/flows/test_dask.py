"""Data stages on a Dask cluster (2 worker processes) against a real Prefect server: byte-identical outputs."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.flows.conftest import write_small_recipe
from tests.flows.prefect_server import running_prefect_server

pytestmark = pytest.mark.slow
COMPARED = ("docs/*.parquet", "rejects/*.parquet", "dedupe/duplicates.parquet", "tokenizer/tokenizer.json",
            "shards/**/*.arrow", "shards/index.parquet")


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("dask-prefect-home")
    saved = {key: os.environ.get(key) for key in ("PREFECT_API_URL", "PREFECT_HOME")}
    with running_prefect_server(home) as api_url:
        # Dask worker processes inherit the environment: without an API URL each would start its own server.
        os.environ.update({"PREFECT_API_URL": api_url, "PREFECT_HOME": str(home)})
        try:
            yield api_url
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def digests(run_dir: Path) -> dict[str, str]:
    return {path.relative_to(run_dir).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for pattern in COMPARED for path in sorted(run_dir.glob(pattern))}


def test_dask_run_is_byte_identical_to_the_local_run(tmp_path: Path, prefect_api: str) -> None:
    from distributed import LocalCluster
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import prepare_on

    recipe = write_small_recipe(tmp_path, packages=("json", "email", "logging"))
    data = yaml.safe_load(recipe.read_text())
    data["data"]["part_size_bytes"] = 100_000  # several parts, so both workers ingest
    recipe.write_text(yaml.safe_dump(data))
    with temporary_settings({PREFECT_API_URL: prefect_api}):
        local = prepare_on(str(recipe), str(tmp_path / "local"))
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
            on_dask = prepare_on(str(recipe), str(tmp_path / "dask"), cluster.scheduler_address)
    assert local["parts_ingested"] >= 3 and on_dask["parts_ingested"] == local["parts_ingested"]
    local_digests, dask_digests = digests(tmp_path / "local"), digests(tmp_path / "dask")
    assert len(local_digests) > 5
    assert dask_digests == local_digests
