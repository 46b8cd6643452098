"""A run dir's working copy published to a real bucket (SeaweedFS) and pulled back: markers last, shards checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.bucket.run_dir import BucketRun
from core.errors import ObjectStoreError
from tests.conftest import build_query_run


def record_requests(run: BucketRun) -> list[tuple[str, str]]:
    """Every PutObject and DeleteObject the run's client sends, in order: ``(operation, key relative to the run)``."""
    sent: list[tuple[str, str]] = []

    def record(params: dict, model: object, **_: object) -> None:
        sent.append((model.name, params["Key"][len(run.prefix) + 1:]))  # type: ignore[attr-defined]

    run._client.meta.events.register("before-parameter-build.s3.PutObject", record)
    run._client.meta.events.register("before-parameter-build.s3.DeleteObject", record)
    return sent


def write_checkpoint(run_dir: Path, step: int) -> None:
    folder = run_dir / "checkpoints" / f"step-{step:07d}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes([step]) * 64)
    (folder / "manifest.json").write_text(json.dumps({"step": step}))
    (run_dir / "checkpoints" / "latest").write_text(json.dumps({"step": step, "path": folder.name}))


def test_publish_puts_markers_last_and_a_fresh_pull_equals_the_run(tmp_path: Path, s3_prefix: str) -> None:
    local = build_query_run(tmp_path / "run")
    write_checkpoint(local, 1)
    (local / "stages" / "sealed").mkdir(parents=True)
    (local / "stages" / "dedupe.json").write_text('{"fingerprint": "a"}')
    (local / "stages" / "sealed" / "prepare.json").write_text("{}")
    (local / "checkpoints" / ".tmp-step-0000002").mkdir()  # a save in the making (or killed): never published
    (local / "checkpoints" / ".tmp-step-0000002" / "model.safetensors").write_bytes(b"half")
    url = f"{s3_prefix}/runs/r"
    run = BucketRun(url, local)
    sent = record_requests(run)
    run.publish()
    keys = [key for _, key in sent]
    markers = ["shards/index.parquet", "checkpoints/step-0000001/manifest.json", "checkpoints/latest",
               "stages/dedupe.json", "stages/ingest/part-00000.json", "stages/sealed/prepare.json"]
    assert keys[-len(markers):] == markers  # in this order, after every output
    assert set(keys[:-len(markers)]) >= {"docs/part-00000.parquet", "shards/split=train/source=a/part-00000.arrow",
                                         "checkpoints/step-0000001/model.safetensors"}
    assert not [key for key in keys if ".tmp-" in key]
    shutil.rmtree(local / "checkpoints" / ".tmp-step-0000002")

    # A new checkpoint, the old one pruned, a stage redone: the stale marker goes first, the pruned folder last.
    sent.clear()
    write_checkpoint(local, 2)
    for path in (local / "checkpoints" / "step-0000001").iterdir():
        path.unlink()
    (local / "checkpoints" / "step-0000001").rmdir()
    (local / "stages" / "dedupe.json").write_text('{"fingerprint": "b"}')
    run.publish()
    assert sent == [("DeleteObject", "stages/dedupe.json"),
                    ("PutObject", "checkpoints/step-0000002/model.safetensors"),
                    ("PutObject", "checkpoints/step-0000002/manifest.json"), ("PutObject", "checkpoints/latest"),
                    ("PutObject", "stages/dedupe.json"),
                    ("DeleteObject", "checkpoints/step-0000001/manifest.json"),
                    ("DeleteObject", "checkpoints/step-0000001/model.safetensors")]
    assert run.publish() == 0  # nothing changed since

    fresh = BucketRun(url, tmp_path / "cache" / "r").pull()
    ours = sorted(path.relative_to(local) for path in local.rglob("*") if path.is_file())
    assert sorted(path.relative_to(fresh) for path in fresh.rglob("*") if path.is_file()) == ours
    assert all((fresh / rel).read_bytes() == (local / rel).read_bytes() for rel in ours)

    # A shard damaged in the bucket (the index unchanged) is refused by a pull into an empty cache, naming it.
    shard = "shards/split=train/source=a/part-00000.arrow"
    damaged = bytearray((local / shard).read_bytes())
    damaged[-100] ^= 0xFF
    run._client.put_object(Bucket=run.bucket, Key=f"{run.prefix}/{shard}", Body=bytes(damaged))
    with pytest.raises(ObjectStoreError, match=rf"^{url}/{shard}: the shard's sha256 differs from shards/index"):
        BucketRun(url, tmp_path / "cache-2" / "r").pull()
