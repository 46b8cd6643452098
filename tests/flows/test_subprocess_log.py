"""flows/runtime/subprocess_log.py: streamed lines, a failing child's tail, and a deadline that kills the whole tree."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from core.errors import ChildProcessFailed
from core.progress_lines import PRINT_EVERY_S, ProgressLine, ProgressPrinter, parse_progress_line
from flows.runtime.subprocess_log import run_streaming

# A launcher stand-in: like torchrun, it starts its "rank" in a session of its own; the rank ignores SIGTERM.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c",
                             "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
                            start_new_session=True)
    with open(sys.argv[1], "w") as out:
        out.write(str(rank.pid))
    print("rank started", flush=True)
    time.sleep(600)
""")


def test_lines_are_logged_and_a_failure_names_its_last_lines(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test-subprocess-log")
    seen: list[str] = []
    with caplog.at_level(logging.INFO, logger="test-subprocess-log"):
        run_streaming([sys.executable, "-c", "print('one'); print('two')"], logger, deadline_s=None,
                      on_line=seen.append)
    assert seen == ["one", "two"]
    assert [record.getMessage() for record in caplog.records] == ["one", "two"]
    with pytest.raises(ChildProcessFailed, match=r"exited with status 3; last output: bad \| worse"):
        run_streaming([sys.executable, "-c", "print('bad'); print('worse'); raise SystemExit(3)"], logger,
                      deadline_s=None)


def test_a_deadline_kills_descendants_in_sessions_of_their_own(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank.pid"
    with pytest.raises(ChildProcessFailed, match="ran past its deadline; last output: rank started"):
        run_streaming([sys.executable, "-c", LAUNCHER, str(pid_file)], logging.getLogger("test-subprocess-log"),
                      deadline_s=3)
    rank = int(pid_file.read_text())
    # Gone, or a zombie left for init to reap: either way it writes nothing more.
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE


def test_rank_stand_in_really_outlives_a_group_kill(tmp_path: Path) -> None:
    """The premise of the test above: killing only the launcher's process group leaves the rank running."""
    pid_file = tmp_path / "rank.pid"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(pid_file)], start_new_session=True,
                                stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None and launcher.stdout.readline().strip() == "rank started"
    rank = psutil.Process(int(pid_file.read_text()))
    try:
        launcher.kill()
        launcher.wait()
        assert rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE
    finally:
        rank.kill()


def test_progress_lines_reach_the_bar_not_the_log(caplog: pytest.LogCaptureFixture) -> None:
    # The whole-split evaluation ran minutes with no line and no bar: its progress now travels as lines.
    logger = logging.getLogger("test-subprocess-log")
    child = ("from core.progress_lines import progress_line; print('loading'); print(progress_line(3, 10, 'rows'));"
             " print('tokenmill-progress {not json'); print(progress_line(10, 10, 'rows')); print('done')")
    seen: list[ProgressLine] = []
    with caplog.at_level(logging.INFO, logger="test-subprocess-log"):
        run_streaming([sys.executable, "-c", child], logger, deadline_s=None, on_progress=seen.append)
    assert seen == [ProgressLine(3, 10, "rows"), ProgressLine(10, 10, "rows")]
    assert [record.getMessage() for record in caplog.records] == ["loading", "tokenmill-progress {not json", "done"]


def test_a_progress_printer_prints_the_first_and_last_lines_and_one_per_interval() -> None:
    out, now = io.StringIO(), [0.0]
    printer = ProgressPrinter("rows", out=out, clock=lambda: now[0])
    for done in range(1, 11):
        printer(done, 10)
        now[0] += PRINT_EVERY_S / 4  # four calls per interval
    lines = [parse_progress_line(line) for line in out.getvalue().splitlines()]
    assert [line.done for line in lines] == [1, 5, 9, 10] and {line.total for line in lines} == {10}
