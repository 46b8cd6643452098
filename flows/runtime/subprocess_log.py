"""Run a child process in its own process group, stream its lines to a logger, enforce a deadline."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import psutil

from core.errors import ChildProcessFailed
from core.progress_lines import ProgressLine, parse_progress_line


def run_streaming(argv: Sequence[str], logger: logging.Logger | logging.LoggerAdapter, *,
                  deadline_s: float | None, env: dict[str, str] | None = None,
                  on_line: Callable[[str], None] | None = None,
                  on_progress: Callable[[ProgressLine], None] | None = None, pass_fds: Sequence[int] = ()) -> None:
    """Run ``argv`` (never through a shell); every output line becomes a log line.

    With ``on_progress``, a progress line (:mod:`core.progress_lines`) goes to it instead of the log.
    ``pass_fds``: descriptors the child inherits (the run-dir lock it works under,
    trainer.parallel.launch.launched_fds).

    Prefect task timeouts cannot stop a child process, so the deadline is enforced here: the whole
    process group gets SIGTERM, then SIGKILL. A non-zero exit raises with the last lines of output.
    """
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1, env=child_env, start_new_session=True, pass_fds=tuple(pass_fds))
    timer = _deadline_timer(process, deadline_s)
    tail: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            if on_progress is not None and (progress := parse_progress_line(line)) is not None:
                on_progress(progress)
                continue
            tail = [*tail[-19:], line]
            logger.info("%s", line)
            if on_line is not None:
                on_line(line)
        returncode = process.wait()
    except BaseException:
        _kill_tree(process)
        raise
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()  # a deadline kill under way ends only when no descendant runs any more
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
        _kill_tree(process)

    timer = _Deadline(deadline_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def _kill_tree(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the child's process group and each of its descendants, SIGKILL what is left after ``grace_s``,
    and return once none of them runs any more.

    Descendants, not only the group: torchrun starts each rank in a session of its own, and a rank that
    outlived its launcher would go on writing checkpoints into the run dir while the task's retry trains there.
    """
    if process.poll() is not None:
        return
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(process, signal.SIGTERM)
    _signal_all(descendants, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(process, signal.SIGKILL)
        process.wait()
    alive = _still_running(descendants, deadline)
    _signal_all(alive, signal.SIGKILL)
    _still_running(alive, time.monotonic() + grace_s)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _signal_all(processes: list[psutil.Process], signum: int) -> None:
    for child in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signum)


def _still_running(processes: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Those of ``processes`` still running at ``deadline`` (polled; an exited one not yet reaped counts as done:
    it is not our child, so ``psutil.wait_procs`` would wait for whoever reaps it)."""
    def running(child: psutil.Process) -> bool:
        try:
            return child.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive = [child for child in processes if running(child)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [child for child in alive if running(child)]
    return alive
