"""flows/runtime/stage_processes.py: stage calls in forked workers, with their progress, errors and lifetime."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from core.errors import SourceReadError
from flows.runtime.stage_processes import run_stage_call, stage_processes, start_fork_server

REPO = Path(__file__).resolve().parents[2]


def count_up(steps: int, on_progress=None) -> tuple[int, int]:
    for step in range(steps):
        if on_progress is not None:
            on_progress(step, 10)
    return os.getpid(), steps


def unreadable(on_progress=None) -> None:
    raise SourceReadError("corpus/a.jsonl.gz: truncated gzip stream; fix or remove the file")


def test_calls_run_in_workers_and_every_report_arrives_before_the_call_returns() -> None:
    reports: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    results: dict[int, tuple[int, int]] = {}

    def one_call(number: int) -> None:
        results[number] = run_stage_call(count_up, 500, on_progress=lambda *report: reports[number].append(report))
        assert len(reports[number]) == 500  # checked as the call returns, not later

    with stage_processes(2):
        threads = [threading.Thread(target=one_call, args=(number,)) for number in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert {number: result[1] for number, result in results.items()} == {0: 500, 1: 500}
    assert os.getpid() not in {result[0] for result in results.values()}
    assert reports[0] == [(step, 10) for step in range(500)] == reports[1]


def test_a_stage_error_keeps_its_type_and_message() -> None:
    with stage_processes(2), pytest.raises(SourceReadError, match=r"a\.jsonl\.gz: truncated gzip"):
        run_stage_call(unreadable)


def exit_in_a_worker(on_progress=None) -> int:
    if multiprocessing.parent_process() is not None:
        os._exit(3)  # as an out-of-memory kill, or a script that re-runs its flow when a worker imports it
    return os.getpid()


def test_a_dead_worker_warns_and_the_calls_run_in_place() -> None:
    with stage_processes(2):
        with pytest.warns(UserWarning, match="a stage worker process died"):
            assert run_stage_call(exit_in_a_worker) == os.getpid()
        assert run_stage_call(count_up, 2)[0] == os.getpid()


def test_without_an_open_pool_the_call_runs_in_place() -> None:
    seen: list[tuple[int, int]] = []
    assert run_stage_call(count_up, 3, on_progress=lambda *report: seen.append(report)) == (os.getpid(), 3)
    assert seen == [(0, 10), (1, 10), (2, 10)]


def fork_server_pid() -> int | None:
    return multiprocessing.forkserver._forkserver._forkserver_pid


def wait_until_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_fork_server_started_early_serves_the_pool_then_stops_and_ctrl_c_does_not_reach_it() -> None:
    """What ``tokenmill prepare`` does: start the workers' fork server before importing Prefect, open the pool later."""
    start_fork_server(("json",))
    early = fork_server_pid()
    assert early is not None and psutil.pid_exists(early)
    blocked = int(re.search(r"SigBlk:\s*([0-9a-f]+)", Path(f"/proc/{early}/status").read_text())[1], 16)
    assert blocked & (1 << (signal.SIGINT - 1)), "a Ctrl-C in the terminal would interrupt the server's imports"
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set()), "this process must still hear it"
    with stage_processes(2):
        worker = run_stage_call(count_up, 1)[0]
        assert fork_server_pid() == early
        assert psutil.Process(worker).ppid() == early  # forked by the early server: no second one was started
    assert wait_until_gone(early)


def test_a_fork_server_started_early_for_work_that_turned_out_done_is_stopped() -> None:
    start_fork_server(("json",))
    early = fork_server_pid()
    with stage_processes(0):  # every part already ingested: no pool
        assert run_stage_call(count_up, 1)[0] == os.getpid()
    assert wait_until_gone(early)


def test_one_part_gets_a_worker_only_from_a_fork_server_started_early() -> None:
    with stage_processes(1):  # starting a fork server for one part costs more than the part gains
        assert run_stage_call(count_up, 1)[0] == os.getpid()
    start_fork_server(("json",))
    early = fork_server_pid()
    with stage_processes(1):  # its imports are paid: the part leaves the flow's process free
        assert psutil.Process(run_stage_call(count_up, 1)[0]).ppid() == early
    assert wait_until_gone(early)


def test_workers_exit_when_the_flow_process_is_killed(tmp_path: Path) -> None:
    """kill -9 of the flow's process mid-call: no orphan worker goes on running (and writing into the run dir)."""
    started = tmp_path / "worker.pid"
    script = textwrap.dedent(f"""
        from flows.runtime.stage_processes import run_stage_call, stage_processes, start_fork_server
        from tests.flows.test_stage_processes import sleep_long

        with stage_processes(2):
            run_stage_call(sleep_long, {str(started)!r})
    """)
    flow = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    pool: list[psutil.Process] = []
    try:
        for _ in range(600):  # the pool's fork server starts, forks a worker, and the worker runs the call
            if started.is_file() and started.read_text():
                break
            assert flow.poll() is None, "the flow exited before its worker ran the call"
            time.sleep(0.1)
        pool = psutil.Process(flow.pid).children(recursive=True)  # the fork server, the worker, a resource tracker
        worker = psutil.Process(int(started.read_text()))
        assert worker in pool and worker.pid != flow.pid
        flow.kill()
        flow.wait(timeout=30)
        _, alive = psutil.wait_procs(pool, timeout=30)
        assert alive == []  # the worker noticed the flow's death; then the fork server had no client left
    finally:
        flow.kill()
        for process in pool:
            if process.is_running():
                process.kill()


def sleep_long(started: str, on_progress=None) -> None:
    Path(started).write_text(str(os.getpid()))
    time.sleep(600)
