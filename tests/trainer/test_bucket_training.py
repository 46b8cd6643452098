"""Training from a run dir in a bucket (real SeaweedFS): ``kill -9`` the trainer, delete its cache, resume from the
bucket's newest checkpoint; the final weights are bitwise those of a run never interrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.bucket_run import BUCKET_RUN_ENV, BucketRun
from tests.trainer.conftest import MakeRunDir
from tests.trainer.test_resume import REPO_ROOT, wait_for_step
from trainer.train import main

SETTINGS = {"max_steps": 8, "checkpoint_every": 2, "eval_every": 8, "log_every": 1, "micro_batch_size": 4}


def start_training(url: str, local: Path, log: Path) -> subprocess.Popen[bytes]:
    """The trainer on a working copy, as `tokenmill train --run-dir s3://…` launches it (it publishes to ``url``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", BUCKET_RUN_ENV: f"{url} {local}"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "trainer.train", "--run-dir", str(local)], cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_killed_trainer_with_its_cache_deleted_resumes_from_the_bucket_bitwise(
        make_run_dir: MakeRunDir, s3_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    straight = make_run_dir("straight", train=SETTINGS)
    assert main(["--run-dir", str(straight)]) == 0  # uninterrupted, on local disk
    expected = (straight / "model" / "model.safetensors").read_bytes()

    url = f"{s3_prefix}/runs/trained"
    prepared = make_run_dir("prepared", train=SETTINGS)
    BucketRun(url, prepared).publish()  # what `tokenmill prepare --run-dir s3://…` leaves in the bucket
    shutil.rmtree(prepared)

    first = BucketRun(url, tmp_path / "cache-a" / "run").pull()  # a machine with an empty cache
    log = tmp_path / "train.log"
    process = start_training(url, first, log)
    wait_for_step(first, SETTINGS["checkpoint_every"] * 2 + 1, process)  # two checkpoints saved (and published)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    shutil.rmtree(tmp_path / "cache-a")

    bucket = BucketRun(url, tmp_path / "cache-b" / "run")
    latest = json.loads(bucket._client.get_object(Bucket=bucket.bucket,
                                                  Key=f"{bucket.prefix}/checkpoints/latest")["Body"].read())
    assert latest["step"] >= SETTINGS["checkpoint_every"] * 2
    second = bucket.pull()  # another empty cache
    monkeypatch.setenv(BUCKET_RUN_ENV, f"{url} {second}")  # re-run here: the uninterrupted run's kernels and threads
    assert main(["--run-dir", str(second)]) == 0
    assert f"Resuming from checkpoint at step {latest['step']}" in capsys.readouterr().out

    exported = BucketRun(url, tmp_path / "cache-c" / "run").pull()  # the export, as the bucket holds it
    assert (exported / "model" / "model.safetensors").read_bytes() == expected
    assert sorted(path.name for path in (exported / "checkpoints").iterdir()) == [
        "latest", "step-0000006", "step-0000008"]  # keep_last 2: the pruned ones are gone from the bucket too
