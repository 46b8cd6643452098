"""Worker processes for CPU-bound stage calls, so a local flow's parts run on all cores.

The local task runner is a thread pool: bars, logs, retries and errors all stay in the flow's process. But
ingest is mostly pure Python (JSON, normalising, filters, building rows) and holds the GIL, so threads alone
use about one core. A flow opens :func:`stage_processes` for its lifetime; a task then hands its stage call
to :func:`run_stage_call`, which runs it in a worker process and forwards the call's progress to the task's
meter. Where no pool is open (a Dask worker, a test calling a task's function) the call runs in place.

Workers come from a fork server (forking the flow's process, which runs threads, is unsafe): a fresh
interpreter that imports the stage's modules once (``preload``) and forks a worker per pool slot. The workers
share those pages with it and with each other, so a worker costs its working data, not another copy of
numba, DuckDB and Arrow; and none pays the imports again. Workers ignore Ctrl-C (the flow stops them) and
exit as soon as the flow's process dies, even by ``kill -9``, so no orphan keeps writing into the run dir that
a re-run is using. Closing the pool stops the fork server too: it would hold its imports for the flow's life.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")
PARENT_POLL_S = 0.5
_DONE = "done"


@dataclass
class _Call:
    on_progress: Callable[..., None] | None
    finished: threading.Event = field(default_factory=threading.Event)


class StageProcesses:
    """A pool of forked workers plus one thread that routes the workers' progress messages to their callers."""

    def __init__(self, max_workers: int, preload: tuple[str, ...] = ()) -> None:
        """``preload``: modules the fork server imports before forking (import-time work is shared)."""
        context = start_fork_server(preload)
        self._messages = context.Queue()
        self._executor = ProcessPoolExecutor(max_workers, mp_context=context, initializer=_start_worker,
                                             initargs=(self._messages, os.getpid()))
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._broken = False
        self._router = threading.Thread(target=self._route, name="stage-progress", daemon=True)
        self._router.start()

    def call(self, function: Callable[..., R], *args: Any, on_progress: Callable[..., None] | None = None,
             **kwargs: Any) -> R:
        """``function(*args, on_progress=…, **kwargs)`` in a worker; ``on_progress`` hears every report first."""
        if self._broken:
            return function(*args, on_progress=on_progress, **kwargs)
        call_id = next(self._ids)
        call = self._calls[call_id] = _Call(on_progress)
        try:
            result = self._executor.submit(_run, call_id, function, args, kwargs, on_progress is not None).result()
            call.finished.wait(timeout=60)  # the worker queued "done" after its last report: none is lost
            return result
        except BrokenProcessPool as err:
            self._broken = True
            warnings.warn(f"a stage worker process died ({err}); this and the remaining calls run in the flow's "
                          "process. If you call a flow from your own script, call it under "
                          "`if __name__ == \"__main__\":` (workers import the script).", stacklevel=2)
            return function(*args, on_progress=on_progress, **kwargs)
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._messages.put(None)
        self._router.join()
        self._messages.close()
        self._messages.join_thread()
        stop_fork_server()

    def _route(self) -> None:
        while (message := self._messages.get()) is not None:
            call_id, kind, payload = message
            call = self._calls.get(call_id)
            if call is None:
                continue
            if kind == _DONE:
                call.finished.set()
            elif call.on_progress is not None:
                call.on_progress(*payload)


_OPEN: dict[str, StageProcesses] = {}
"""The pool of this process while a flow holds :func:`stage_processes` open."""


def start_fork_server(preload: tuple[str, ...]) -> multiprocessing.context.ForkServerContext:
    """Start this process's fork server now (if none runs), importing ``preload``; returns its context.

    It returns at once: the server imports ``preload`` in its own process, so a command calls this before it
    imports Prefect and the flows, and the two import side by side (~1.7 s each on 2 cores). A pool opened
    later with the same ``preload`` forks its workers from this server. SIGINT is blocked while it starts, and
    so stays blocked in the server and its workers (a blocked mask is inherited): a Ctrl-C reaches the
    command, which stops them, instead of printing a KeyboardInterrupt from the middle of the server's imports.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return context


def _fork_server_running() -> bool:
    """Whether this process has a fork server that no :func:`stop_fork_server` is stopping."""
    stopping = _STOPPING.get("thread")
    return ((stopping is None or not stopping.is_alive())
            and getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None)


def stop_fork_server() -> None:
    """Stop this process's fork server (``ForkServer._stop``, private: hence getattr), without waiting for it.

    The stop closes the server's "alive" pipe (it then exits), then waits for it to exit: up to its whole
    preload when it is still importing (a server started early for parts that turned out to be done), and
    ~0.3 s of interpreter teardown otherwise. The wait happens in a daemon thread; the process is reaped there.
    """
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
    if stop is not None:
        _STOPPING["thread"] = stopping = threading.Thread(target=stop, name="fork-server-stop", daemon=True)
        stopping.start()


_STOPPING: dict[str, threading.Thread] = {}
"""The thread of the last :func:`stop_fork_server` (a later pool must not count on a server it is stopping)."""


@contextlib.contextmanager
def stage_processes(max_workers: int | None = None, preload: tuple[str, ...] = ()) -> Iterator[None]:
    """Open a pool of ``max_workers`` (default: all cores) for :func:`run_stage_call` until the block ends.

    ``preload``: the modules the stage calls need, imported once by the fork server (see the module doc).
    When a pool is already open (a nested flow) it opens none. One worker (one core, one part) gets a pool
    only from a fork server started early (:func:`start_fork_server`): its imports are paid, and the part
    leaves the flow's process free; starting one for it would cost about a second of imports, more than one
    part gains. With no worker (every part done) it stops a fork server started early.
    """
    workers = (os.cpu_count() or 1) if max_workers is None else max_workers
    if "pool" in _OPEN:
        yield
        return
    if workers < 1 or (workers == 1 and not _fork_server_running()):
        stop_fork_server()
        yield
        return
    _OPEN["pool"] = pool = StageProcesses(workers, preload)
    try:
        yield
    finally:
        del _OPEN["pool"]
        pool.close()


def run_stage_call(function: Callable[..., R], *args: Any, on_progress: Callable[..., None] | None = None,
                   **kwargs: Any) -> R:
    """``function(*args, on_progress=on_progress, **kwargs)``, in a worker process when a pool is open."""
    pool = _OPEN.get("pool")
    if pool is None:
        return function(*args, on_progress=on_progress, **kwargs)
    return pool.call(function, *args, on_progress=on_progress, **kwargs)


# ---- in the worker process ----------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _start_worker(messages: Any, flow_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER["messages"] = messages
    threading.Thread(target=_exit_with_flow, args=(flow_pid,), name="flow-watch", daemon=True).start()


def _exit_with_flow(flow_pid: int) -> None:
    """Exit once the flow's process is gone; the fork server, not the flow, is this worker's parent."""
    try:
        watch = os.pidfd_open(flow_pid)  # readable when that process exits; never confused by a reused pid
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd (not Linux, or an old kernel): poll instead
        while _is_alive(flow_pid):
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    select.select([watch], [], [])
    os._exit(1)  # the flow is gone: stop at once, mid-write included (outputs are temp files until renamed)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(call_id: int, function: Callable[..., R], args: tuple, kwargs: dict, reports: bool) -> R:
    messages = _WORKER["messages"]

    def report(*payload: Any) -> None:
        messages.put((call_id, "progress", payload))

    try:
        return function(*args, on_progress=report if reports else None, **kwargs)
    finally:
        messages.put((call_id, _DONE, None))
