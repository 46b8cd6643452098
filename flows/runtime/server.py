"""The temporary Prefect server of a run with no server configured: never outlives tokenmill, never dies before it.

With no ``PREFECT_API_URL``, Prefect itself would start ``python -m uvicorn … prefect.server.api.server:create_app``
as a child (``SubprocessASGIServer``) the first time a flow talks to its API, and stop it at exit. Three ways
that went wrong:

- ``kill -9`` (or an OOM kill) of tokenmill skips every exit handler: the server went on running with
  ppid 1 (~220 MB) for minutes, one more after each killed run;
- it shared tokenmill's process group, so a Ctrl-C in the terminal stopped it too, and the flow, still
  reporting its state to it, retried ``httpx.ConnectError`` for minutes instead of exiting;
- it started only when the flow began, after tokenmill had imported Prefect and its flows, so each command
  paid both one after the other (~4.5 s of server start-up after ~6 s of imports on 2 cores).

:func:`start_temporary_server` starts it first, before Prefect is imported: the server boots while tokenmill
imports, and Prefect, finding ``PREFECT_API_URL`` set, uses it as it would a configured server. The server
runs in a session of its own (a Ctrl-C reaches tokenmill only) through this module, which stops it within a
second of its parent's death whatever killed the parent; tokenmill stops it at exit, after Prefect's exit
handlers have sent their last logs. :func:`guard_temporary_server` does the same for a temporary server that
Prefect starts itself (``tokenmill serve``).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import resource
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, Any

from core.errors import OutOfSpaceError, TokenmillError
from core.files.atomic import no_space_message

ORPHAN_POLL_S = 0.5
"""How often the server checks that the process that started it is still its parent."""
SHUTDOWN_GRACE_S = 10.0
"""How long an orphaned server may take to shut down cleanly (uvicorn on SIGTERM) before it exits hard."""
STARTUP_TIMEOUT_S = 120.0
"""How long tokenmill waits for its temporary server to answer ``/api/health`` (a cold start on a loaded
2-core machine took up to ~15 s)."""
APP = "prefect.server.api.server:create_app"
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
              "PREFECT_API_BLOCKS_REGISTER_ON_START": "false", "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}
"""What Prefect's own temporary server runs with (``SubprocessASGIServer._run_uvicorn_command``), less block
registration: to register (or to check, when memoized) the block types of every installed Prefect collection,
the server imports them all at start, prefect-dask and with it dask.distributed (measured: 0.5 CPU-s of the
start and 27 MB). tokenmill's runs use no blocks; a server that serves a UI (``tokenmill serve``) registers them."""
RUN_THIS_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
"""The server's ``python -c``: this file by its path, not ``-m flows.runtime.server``, which would import a ``flows``
package of the user's from the working directory (a Prefect project often has one) instead of ours."""
DATABASE_WRITE_FAILED = ("disk I/O error", "database or disk is full", "File too large", "No space left",
                         "Disk quota exceeded")
"""What SQLite says (through the server's tracebacks) for a write past a file-size limit (EFBIG: ``disk I/O
error``) or onto a full disk (``database or disk is full``)."""
LOW_SPACE_BYTES = 64 << 20
"""Below this much free room beside the server's database, its failure is put down to the full disk."""


@dataclass
class TemporaryServer:
    """A running temporary server: its process and the API URL this process and its children use."""

    process: subprocess.Popen[bytes]
    api_url: str
    log: IO[bytes] | None = None
    """Where the server's own output goes (an unnamed temporary file): its tracebacks are not the command's
    output; :func:`server_failure` reads them when the server fails (None: the terminal)."""

    def log_tail(self, max_bytes: int = 1 << 16) -> str:
        """The last ``max_bytes`` of the server's output ("" when it goes to the terminal)."""
        if self.log is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self.log.seek(max(0, os.fstat(self.log.fileno()).st_size - max_bytes))
            return self.log.read().decode("utf-8", "replace")
        return ""

    def wait_until_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the server answers ``/api/health``; TokenmillError if it exits or stays silent."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise server_failure(f"exited with status {self.process.returncode} before it was ready",
                                     self.log_tail())
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.api_url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
            time.sleep(0.05)
        raise TokenmillError(f"the temporary Prefect server did not answer within {timeout_s:.0f} s; set "
                             "PREFECT_API_URL to a running server (prefect server start)")

    def stop(self, timeout_s: float = SHUTDOWN_GRACE_S) -> None:
        """SIGTERM the server (uvicorn finishes its requests) and wait for it; kill it if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


RUNNING: list[TemporaryServer] = []
"""The temporary server this process started (at most one), for :func:`flows.cli.failures.user_error`."""


def start_temporary_server(*, log_to_terminal: bool = False) -> TemporaryServer | None:
    """Start tokenmill's temporary server now, unless the user configured Prefect or Prefect is imported already.

    "Configured" is what :func:`flows.runtime.settings.configure_environment` leaves alone: a ``PREFECT_API_URL`` or
    a ``PREFECT_HOME`` of the user's own (its profile may name a server), or temporary servers switched off.
    Otherwise the server binds a free port itself and reports it, ``PREFECT_API_URL`` is set in this
    process's environment (Prefect reads it when it is imported; launched processes inherit it), and the
    server is stopped at exit, after Prefect's own exit handlers (atexit runs them in reverse order of
    registration, and Prefect registers its handlers after this). Returns None when nothing was started (then
    Prefect starts its own when it needs one, and guard_temporary_server guards it). The server's own output
    (its tracebacks of failed requests) goes to an unnamed temporary file unless ``log_to_terminal`` (--debug).
    """
    # not at the top: this file also runs by path, where `flows` may be another package
    from flows.runtime.settings import TOKENMILL_PREFECT_HOME_ENV

    if "prefect" in sys.modules:  # too late to name a server to Prefect: it starts its own (guard_temporary_server)
        return None
    ephemeral = os.environ.get("PREFECT_SERVER_EPHEMERAL_ENABLED", "true").strip().lower()
    if ("PREFECT_API_URL" in os.environ or os.environ.get(TOKENMILL_PREFECT_HOME_ENV) != os.environ.get("PREFECT_HOME")
            or ephemeral in ("0", "false", "no", "off")):
        return None
    read_port, write_port = os.pipe()
    log = None if log_to_terminal else tempfile.TemporaryFile()  # noqa: SIM115 - the server's, kept open with it
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", RUN_THIS_FILE, __file__, str(os.getpid()), str(write_port), APP],
            env={**os.environ, **SERVER_ENV}, pass_fds=(write_port,), start_new_session=True, stdout=log,
            stderr=log)
    finally:
        os.close(write_port)
    with os.fdopen(read_port) as reported:
        port = reported.readline().strip()
    server = TemporaryServer(process, f"http://127.0.0.1:{port}/api", log)
    if not port.isdigit():
        process.wait()
        raise server_failure(f"exited with status {process.returncode} before it bound a port", server.log_tail())
    os.environ["PREFECT_API_URL"] = server.api_url
    atexit.register(server.stop)
    RUNNING.append(server)
    return server


def server_failure(what: str, log_tail: str) -> TokenmillError:
    """The temporary Prefect server ``what`` (failed, exited before it was ready): one line saying why when its
    output (``log_tail``) shows a failed write of its database and a file-size limit or a full disk is the cause;
    else what failed, where its database is and what to try."""
    database = prefect_database()
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    failed_write = any(sign in log_tail for sign in DATABASE_WRITE_FAILED)
    if failed_write and limit != resource.RLIM_INFINITY:
        return OutOfSpaceError(f"the temporary Prefect server {what}: it could not write its database {database} "
                               f"past the file-size limit of {limit:,} bytes (`ulimit -f`); lift the limit (or free "
                               "space) and re-run: finished work is kept.")
    if failed_write and _free_bytes(database) < LOW_SPACE_BYTES:
        return OutOfSpaceError(f"the temporary Prefect server {what}: it could not write its database: "
                               + no_space_message(database, errno.ENOSPC, None))
    last = next((line.strip() for line in reversed(log_tail.splitlines()) if line.strip()), "")
    said = f" ({last[:200]})" if last else ""
    return TokenmillError(f"the temporary Prefect server {what}{said}; its database is {database}: run with --debug "
                          "to see its output, or set PREFECT_API_URL to a running server (prefect server start). "
                          "Finished work is kept.")


def prefect_database() -> Path:
    """The SQLite file of the temporary server: ``$PREFECT_HOME/prefect.db`` (Prefect's default)."""
    home = os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
    return Path(home) / "prefect.db"


def _free_bytes(path: Path) -> int:
    folder = next((parent for parent in (path.parent, *path.parents) if parent.is_dir()), Path("/"))
    return os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize


def guard_temporary_server() -> None:
    """Make the temporary server Prefect may start in this process one that dies with it; idempotent.

    Does nothing when a server is configured (``PREFECT_API_URL``), when temporary servers are switched
    off, or when Prefect already started its own (it keeps serving this process).
    """
    # not at import: Prefect is imported only after start_temporary_server (it reads PREFECT_API_URL once)
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    # Prefect's server module (~3 s): only where Prefect starts its own
    from prefect.server.api.server import SubprocessASGIServer

    current = SubprocessASGIServer._instances.get(None)
    guarded = _guarded_server_class()
    if isinstance(current, guarded) or (current is not None and current.running):
        return
    SubprocessASGIServer._instances[None] = guarded()


@cache
def _guarded_server_class() -> type:
    """``SubprocessASGIServer`` whose uvicorn runs through :func:`serve_while_parent_lives` in its own session.

    Defined on first use: importing Prefect's server module costs ~3 s, paid only where Prefect would
    import it anyway (a flow with no server configured).
    """
    # Prefect's server module (~3 s): only where Prefect starts its own
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings  # Prefect: as above

    class GuardedTemporaryServer(SubprocessASGIServer):
        _instances: dict[int | None, Any] = {}  # its own registry: constructing one never returns Prefect's

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            """Prefect's command and environment (``SubprocessASGIServer._run_uvicorn_command``), guarded."""
            import prefect  # loaded already: this class subclasses Prefect's

            uvicorn_args = ["--app-dir", str(prefect.__module_path__.parent), "--factory",
                            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                            str(self.port), "--log-level", "error", "--lifespan", "on"]
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            return subprocess.Popen([sys.executable, "-c", RUN_THIS_FILE, __file__, str(os.getpid()), *uvicorn_args],
                                    env=env, start_new_session=True)

    return GuardedTemporaryServer


def serve_while_parent_lives(parent_pid: int, uvicorn_args: list[str]) -> None:
    """Run uvicorn with ``uvicorn_args`` in this process until it stops, or until ``parent_pid`` is gone.

    Polling the parent works whatever killed it and on any POSIX system (``PR_SET_PDEATHSIG`` is Linux-only
    and fires when the parent's *thread* exits, and Prefect may start the server from any thread).
    """
    threading.Thread(target=_stop_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True).start()
    sys.argv = ["uvicorn", *uvicorn_args]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)


def serve_on_free_port(parent_pid: int, port_fd: int, app: str) -> None:
    """Bind a free loopback port, write its number to ``port_fd``, then serve Prefect's ``app`` on it.

    The socket listens before the port is reported and before Prefect's app is imported (seconds), so the
    parent can name the URL at once; a request sent early waits in the listen backlog. No port is chosen
    by the parent and then bound by the child, so no other process can take it in between.
    """
    threading.Thread(target=_stop_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True).start()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    with os.fdopen(port_fd, "w") as report:
        report.write(f"{listener.getsockname()[1]}\n")
    import uvicorn  # uvicorn: only in the server's own process

    uvicorn.Server(uvicorn.Config(app, factory=True, log_level="error", lifespan="on")).run(sockets=[listener])


def _stop_when_orphaned(parent_pid: int) -> None:
    """Once this process is no longer ``parent_pid``'s child, SIGTERM it (uvicorn shuts down), then exit hard."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[3] == APP:  # python -c RUN_THIS_FILE …/flows/server.py PARENT_PID PORT_FD APP
        serve_on_free_port(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    else:  # python -c RUN_THIS_FILE …/flows/server.py PARENT_PID UVICORN_ARGS… (Prefect-started, guarded)
        serve_while_parent_lives(int(sys.argv[1]), sys.argv[2:])
