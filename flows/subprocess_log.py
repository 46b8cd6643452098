"""Run a child process in its own process group, stream its lines to a logger, enforce a deadline."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from pipeline.errors import TokenmillError


class ChildProcessFailed(TokenmillError):
    """The child process failed or ran past its deadline; worth a retry (training resumes from a checkpoint)."""

    retryable = True


def run_streaming(argv: Sequence[str], logger: logging.Logger | logging.LoggerAdapter, *,
                  deadline_s: float | None, env: dict[str, str] | None = None,
                  on_line: Callable[[str], None] | None = None) -> None:
    """Run ``argv`` (never through a shell); every output line becomes a log line.

    Prefect task timeouts cannot stop a child process, so the deadline is enforced here: the whole
    process group gets SIGTERM, then SIGKILL. A non-zero exit raises with the last lines of output.
    """
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1, env=child_env, start_new_session=True)
    timer = _deadline_timer(process, deadline_s)
    tail: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            tail = [*tail[-19:], line]
            logger.info("%s", line)
            if on_line is not None:
                on_line(line)
        returncode = process.wait()
    except BaseException:
        _kill_group(process)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    if returncode != 0:
        why = "ran past its deadline" if returncode in (-signal.SIGTERM, -signal.SIGKILL) and timer and \
            timer.fired else f"exited with status {returncode}"
        raise ChildProcessFailed(f"{argv[0]} … {why}; last output: " + " | ".join(tail[-5:]))


class _Deadline(threading.Timer):
    fired = False


def _deadline_timer(process: subprocess.Popen, deadline_s: float | None) -> _Deadline | None:
    if deadline_s is None:
        return None

    def expire() -> None:
        timer.fired = True
        _kill_group(process)

    timer = _Deadline(deadline_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def _kill_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
