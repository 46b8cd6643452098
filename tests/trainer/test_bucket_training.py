"""Training from a run dir in a bucket (real SeaweedFS): ``kill -9`` the trainer, delete its cache, resume from the
bucket's newest checkpoint; the final weights are bitwise those of a run never interrupted. The same when the store
goes away while a checkpoint is being published and comes back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.bucket import run_dir as bucket_run
from core.bucket.run_dir import BUCKET_RUN_ENV, BucketRun
from tests.pipeline.test_s3_faults import BUCKET, restartable_s3  # noqa: F401 - a store this module may kill
from tests.s3_server import SeaweedServer
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


@pytest.mark.slow
def test_two_machines_with_separate_caches_train_together_from_one_bucket_run_dir(
        make_run_dir: MakeRunDir, s3_prefix: str, tmp_path: Path) -> None:
    from tests.trainer.test_multinode import clean_environment, free_port
    from trainer.parallel.launch import launch_command

    url = f"{s3_prefix}/runs/two-machines"
    prepared = make_run_dir("prepared", train={"max_steps": 4, "checkpoint_every": 2, "eval_every": 2})
    BucketRun(url, prepared).publish()
    port = free_port()
    logs = [tmp_path / f"machine-{rank}.log" for rank in (0, 1)]
    machines = []
    for rank, log in enumerate(logs):  # each "machine" has a cache of its own: they share only the bucket
        env = {**clean_environment(), "XDG_CACHE_HOME": str(tmp_path / f"cache-{rank}")}
        with log.open("w") as out:
            machines.append(subprocess.Popen(
                launch_command(url, 2, num_machines=2, machine_rank=rank,  # type: ignore[arg-type]
                               main_process_ip="127.0.0.1", main_process_port=port),
                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [machine.wait(timeout=240) for machine in machines]
    finally:
        for machine in machines:
            if machine.poll() is None:
                os.killpg(machine.pid, signal.SIGKILL)
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "on 2 process(es)" in outputs[0]  # one process group across both launches

    published = BucketRun(url, tmp_path / "reader" / "run").pull()
    step = published / "checkpoints" / "step-0000004"
    assert {"random_states_0.pkl", "random_states_1.pkl", "manifest.json"} <= {path.name for path in step.iterdir()}
    assert "random_states_1.pkl" in json.loads((step / "manifest.json").read_text())["files"]
    assert (published / "model" / "model.safetensors").is_file()
    assert not [path for path in (published / "checkpoints").iterdir() if path.name.startswith(".tmp-")]


class KillOnFirstUpload:
    """A botocore ``before-send`` hook: kills the store as the first PUT of a key containing ``marker`` is about to
    go out, so the publication of that checkpoint is cut before its first file (the request then meets a closed
    port, as with a store that went away)."""

    def __init__(self, server: SeaweedServer, marker: str) -> None:
        self.server, self.marker, self.killed = server, marker, False

    def __call__(self, request: Any, **_: Any) -> None:
        if not self.killed and request.method == "PUT" and self.marker in request.url:
            self.killed = True
            self.server.kill()


@pytest.mark.slow
def test_a_store_lost_mid_checkpoint_then_back_resumes_to_the_weights_of_an_uninterrupted_run(
        make_run_dir: MakeRunDir, restartable_s3: SeaweedServer, tmp_path: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    straight = make_run_dir("straight", train=SETTINGS)
    assert main(["--run-dir", str(straight)]) == 0
    expected = (straight / "model" / "model.safetensors").read_bytes()

    url = f"s3://{BUCKET}/runs/mid-checkpoint"
    prepared = make_run_dir("prepared", train=SETTINGS)
    BucketRun(url, prepared).publish()
    shutil.rmtree(prepared)
    local = BucketRun(url, tmp_path / "cache" / "run").pull()
    monkeypatch.setenv(BUCKET_RUN_ENV, f"{url} {local}")
    killer = KillOnFirstUpload(restartable_s3, "/checkpoints/step-0000004/")
    real_client = bucket_run.s3_client

    def client_with_the_hook() -> Any:
        made = real_client()
        made.meta.events.register("before-send.s3.PutObject", killer)
        return made

    monkeypatch.setattr(bucket_run, "s3_client", client_with_the_hook)
    assert main(["--run-dir", str(local)]) == 2  # the publication of step 4 fails: one line, exit 2
    monkeypatch.setattr(bucket_run, "s3_client", real_client)
    assert killer.killed
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].startswith("error: ") and url in said[-1], said[-3:]

    restartable_s3.start()  # the same data folder and ports: the bucket as the cut publication left it
    bucket = BucketRun(url, tmp_path / "reader" / "run")
    latest = json.loads(bucket._client.get_object(Bucket=bucket.bucket,
                                                  Key=f"{bucket.prefix}/checkpoints/latest")["Body"].read())
    assert latest["step"] == 2, "the bucket still names the last checkpoint it holds whole"
    BucketRun(url, local).pull()  # what the re-run command does first, on the same machine's cache
    assert not (local / "checkpoints" / "step-0000004").exists(), "no half checkpoint is left in the copy"
    assert main(["--run-dir", str(local)]) == 0
    assert "Resuming from checkpoint at step 2" in capsys.readouterr().out
    exported = bucket.pull()
    assert (exported / "model" / "model.safetensors").read_bytes() == expected
