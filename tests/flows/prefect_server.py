"""A real `prefect server start` on 127.0.0.1 for tests of deployments, workers and Dask."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

PREFECT = str(Path(sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@contextlib.contextmanager
def running_prefect_server(home: Path, startup_s: float = 120) -> Iterator[str]:
    """Start a server in its own process group, wait until /api/health answers, stop it after."""
    port = free_port()
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                               env=server_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"prefect server exited: {(home / 'server.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
                if response.status == 200:
                    break
            time.sleep(1)
        else:
            raise RuntimeError("prefect server did not become healthy")
        yield api_url
    finally:
        stop_group(process)
        log.close()


@contextlib.contextmanager
def background(argv: list[str], env: dict[str, str], log_path: Path, cwd: Path | None = None) -> Iterator[None]:
    """Run a long-lived command (serve, worker) for the duration of the block; SIGINT stops it."""
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                               start_new_session=True)
    try:
        yield
    finally:
        stop_group(process)
        log.close()


def stop_group(process: subprocess.Popen) -> None:
    """SIGINT the process group (Prefect's servers and workers stop cleanly on it), SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
