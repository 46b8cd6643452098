"""The temporary Prefect server of a run with no server configured: never outlives tokenmill, never dies before it.

With no ``PREFECT_API_URL``, Prefect starts ``python -m uvicorn … prefect.server.api.server:create_app`` as a
child (``SubprocessASGIServer``, the one "Starting temporary server on …" names) and stops it at exit. Two
ways that went wrong:

- ``kill -9`` (or an OOM kill) of tokenmill skips every exit handler: the server went on running with
  ppid 1 (~220 MB) for minutes, one more after each killed run;
- it shared tokenmill's process group, so a Ctrl-C in the terminal stopped it too, and the flow, still
  reporting its state to it, retried ``httpx.ConnectError`` for minutes instead of exiting.

:func:`guard_temporary_server` registers, under the key Prefect looks its temporary server up by (what
Prefect's own ``prefect_test_harness`` does), a server started the same way but in a session of its own (a
Ctrl-C reaches tokenmill only, which stops the server at exit as before) and through this module, which
stops it within a second of its parent's death whatever killed the parent. It starts when Prefect first
needs it, exactly as before, so start-up time is unchanged.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from functools import cache
from typing import Any

ORPHAN_POLL_S = 0.5
"""How often the server checks that the process that started it is still its parent."""
SHUTDOWN_GRACE_S = 10.0
"""How long an orphaned server may take to shut down cleanly (uvicorn on SIGTERM) before it exits hard."""
RUN_THIS_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
"""The server's ``python -c``: this file by its path, not ``-m flows.server``, which would import a ``flows``
package of the user's from the working directory (a Prefect project often has one) instead of ours."""


def guard_temporary_server() -> None:
    """Make the temporary server Prefect may start in this process one that dies with it; idempotent.

    Does nothing when a server is configured (``PREFECT_API_URL``), when temporary servers are switched
    off, or when Prefect already started its own (it keeps serving this process).
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
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
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class GuardedTemporaryServer(SubprocessASGIServer):
        _instances: dict[int | None, Any] = {}  # its own registry: constructing one never returns Prefect's

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            """Prefect's command and environment (``SubprocessASGIServer._run_uvicorn_command``), guarded."""
            import prefect

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


def _stop_when_orphaned(parent_pid: int) -> None:
    """Once this process is no longer ``parent_pid``'s child, SIGTERM it (uvicorn shuts down), then exit hard."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SHUTDOWN_GRACE_S)
    os._exit(1)


if __name__ == "__main__":  # python -c RUN_THIS_FILE …/flows/server.py PARENT_PID UVICORN_ARGS…
    serve_while_parent_lives(int(sys.argv[1]), sys.argv[2:])
