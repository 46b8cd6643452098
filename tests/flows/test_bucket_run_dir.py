"""``tokenmill prepare --run-dir s3://…``: a run dir in a real bucket (SeaweedFS), as two machines would share it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.conftest import write_small_recipe

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


def bucket_objects(url: str) -> dict[str, tuple[int, str]]:
    from core.bucket.run_dir import BucketRun

    return BucketRun(url, Path("/nonexistent"))._list()


@pytest.mark.slow
def test_prepare_into_a_bucket_run_dir_racing_then_skipped_with_the_cache_deleted(
        tmp_path: Path, s3_prefix: str, prefect_server: None) -> None:
    from prefect.settings import PREFECT_API_URL

    recipe = write_small_recipe(tmp_path, packages=("json",))
    url = f"{s3_prefix}/runs/slice"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONUNBUFFERED": "1"}
    caches = {name: tmp_path / f"cache-{name}" for name in ("a", "b", "c")}

    def prepare(cache: str) -> subprocess.Popen[str]:
        return subprocess.Popen([TOKENMILL, "prepare", str(recipe), "--run-dir", url], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**env, "XDG_CACHE_HOME": str(caches[cache])})

    # Two "machines" (separate caches) race for the same bucket run dir: one prepares, the other is refused.
    racers = {"a": prepare("a"), "b": prepare("b")}
    results = {name: (racer.wait(timeout=600), *racer.communicate()) for name, racer in racers.items()}
    codes = sorted(code for code, _, _ in results.values())
    assert codes == [0, 2], {name: (code, err[-1500:]) for name, (code, _, err) in results.items()}
    refused = next(err for code, _, err in results.values() if code == 2)
    assert refused.strip().startswith(f"error: {url}: run directory is in use by pid "), refused
    assert len(refused.strip().splitlines()) == 1

    published = bucket_objects(url)
    assert {"run.yaml", "shards/index.parquet", "stages/dedupe.json", "stages/tokenizer.json",
            "stages/sealed/prepare.json", "tokenizer/tokenizer.json"} <= set(published)
    assert any(key.startswith("shards/split=train/") for key in published)
    assert ".lock" not in published  # released

    # Every working copy deleted: a third machine pulls the run and finds every stage done (nothing re-uploaded).
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    sealed = prepare("c")
    code, _, err = sealed.wait(timeout=600), *sealed.communicate()
    assert code == 0 and "prepare: nothing changed since it last finished" in err, err[-2000:]
    assert bucket_objects(url) == published, "a sealed command changes nothing"
    # Again without the seal (which holds while every stage is done): the stages say so themselves.
    import s3fs

    s3fs.S3FileSystem().rm(f"{url.removeprefix('s3://')}/stages/sealed/prepare.json")
    shutil.rmtree(caches["c"], ignore_errors=True)
    again = prepare("c")
    code, _, err = again.wait(timeout=600), *again.communicate()
    assert code == 0, err[-2000:]
    assert "tokenizer: skipped (up to date)" in err and re.search(r"dedupe: \d+ docs: skipped \(up to date\)", err)
    assert len(re.findall(r"pack \S+: [\d,]+ tokens, \d+ rows: skipped \(up to date\)", err)) == 2  # train and val
    after = bucket_objects(url)
    # Only what every call records changes: its stage times, and the seal of the finished command.
    assert sorted(key for key in after if after[key] != published.get(key)) == ["metrics/stage_times.jsonl",
                                                                                "stages/sealed/prepare.json"]


def test_a_flow_called_without_the_command_refuses_a_bucket_run_dir(tmp_path: Path) -> None:
    """A deployment would work on a working copy it never pulls nor publishes: one line, before any work."""
    from core.errors import ConfigError
    from flows.recipe import as_resolved

    recipe = write_small_recipe(tmp_path, packages=("json",))
    with pytest.raises(ConfigError, match=r"run dir s3://bucket/runs/x is in a bucket; the `tokenmill` command"):
        as_resolved(recipe, "s3://bucket/runs/x")
    assert as_resolved(recipe, tmp_path / "local").paths.root == (tmp_path / "local").resolve()
