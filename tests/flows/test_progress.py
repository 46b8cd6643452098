"""flows.progress.bars and flows.progress.training: one line per finished stage call, live bars on a terminal, and
the training bar and artifact that follow the metrics files."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console
from rich.progress import Progress

from core.rundir import RunPaths
from core.shards.store import ShardInfo
from flows.progress import training as training_progress
from flows.progress.bars import (
    QUIET_ENV,
    Meter,
    describe_rates,
    live_progress,
    open_shared_bar,
    reports_progress,
    stage_meter,
)
from flows.progress.training import MetricsTail, TrainingArtifact, TrainingBar, TrainingFollower, follow_training
from flows.runtime.subprocess_log import run_streaming
from tests.flows.conftest import write_small_recipe
from tests.flows.test_cli import TOKENMILL
from trainer.metrics.sink import MetricsSink

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
BAR = "━"


def test_counts_and_rates_from_a_summary() -> None:
    line = describe_rates("ingest-part", {"num_documents": 1000, "num_bytes": 2_000_000}, 2.0)
    assert line == "ingest-part: 1,000 docs, 2.0 MB in 2.00 s (500 docs/s, 1.0 MB/s)"


def test_shard_infos_skipped_stages_and_plans() -> None:
    infos = [ShardInfo("a", "train", "s", 10, 2560, "x", "t", 256),
             ShardInfo("b", "train", "s", 5, 1000, "x", "t", 256)]
    assert describe_rates("pack", infos, 1.0) == "pack: 3,560 tokens, 15 rows in 1.00 s (3,560 tokens/s, 15 rows/s)"
    assert describe_rates("dedupe", {"num_documents_in": 7, "skipped": True}, 0.1) == \
        "dedupe: 7 docs: skipped (up to date)"
    assert describe_rates("plan-ingest", [{"part_id": 0}, {"part_id": 1}], 0.1) == "plan-ingest: 2 part(s) to do"
    decontaminated = {"enabled": True, "num_train_checked": 1700, "num_contaminated": 3}
    assert describe_rates("decontaminate", decontaminated, 0.5) == \
        "decontaminate: 1,700 docs in 0.50 s (3,400 docs/s)"


def test_decorator_logs_once_and_quiet_silences_it(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    @reports_progress("demo")
    def stage(n: int) -> dict[str, int]:
        return {"num_rows": n}

    with caplog.at_level(logging.INFO, logger="tokenmill.progress"):
        assert stage(4) == {"num_rows": 4}
        monkeypatch.setenv(QUIET_ENV, "1")
        stage(5)
    lines = [record.getMessage() for record in caplog.records if record.name == "tokenmill.progress"]
    assert len(lines) == 1 and lines[0].startswith("demo: 4 rows in ")


# ---- live bars, rendered to an in-memory terminal -----------------------------------------------------


class FakeClock:
    """Progress timestamps under the test's control: rates and ETAs become exact numbers."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=160, color_system=None)


def rows(progress: Progress) -> dict[str, str]:
    """The bars as plain text, one row per stage, keyed by stage name."""
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(progress.make_tasks_table(progress.tasks))
    lines = [line.strip() for line in console.file.getvalue().splitlines() if line.strip()]
    return {task.description: next(line for line in lines if line.startswith(task.description))
            for task in progress.tasks}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def bars(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Progress]:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    with live_progress(terminal(), get_time=clock) as progress:
        assert progress is not None
        yield progress


def test_ingest_parts_share_one_bar_with_mb_per_s_docs_per_s_and_eta(bars: Progress, clock: FakeClock) -> None:
    open_shared_bar("ingest", "bytes", total=4_000_000, num_calls=2)
    with stage_meter("ingest", "bytes") as first, stage_meter("ingest", "bytes") as second:
        for meter, docs in ((first, 100), (second, 50)):  # 1 MB every 0.5 s, from either part
            clock.now += 0.5
            meter.advance(1_000_000, docs=docs)
        running = rows(bars)["ingest"]
        assert "2.0/4.0 MB" in running and "2.0 MB/s" in running and "eta 0:01" in running
        assert "150 docs (150 docs/s)" in running
        for meter, docs in ((first, 100), (second, 50)):
            clock.now += 0.5
            meter.advance(1_000_000, docs=docs)
    [task] = bars.tasks
    assert task.finished and task.completed == task.total == 4_000_000
    done = rows(bars)["ingest"]
    assert "4.0 MB 2.0 MB/s 0:02" in done and "eta" not in done and "300 docs (150 docs/s)" in done


def test_failed_call_takes_back_its_share_so_the_retry_counts_once(bars: Progress) -> None:
    open_shared_bar("ingest", "bytes", total=3_000, num_calls=2)
    with stage_meter("ingest", "bytes") as meter:
        meter.advance(1_000, docs=1)
    with pytest.raises(OSError), stage_meter("ingest", "bytes") as meter:
        meter.advance(1_500, docs=7)
        raise OSError("disk went away")
    assert bars.tasks[0].completed == 1_000 and bars.tasks[0].fields["counts"] == {"docs": 1}
    with stage_meter("ingest", "bytes") as meter:  # the retry
        meter.advance(2_000, docs=2)
    assert bars.tasks[0].finished and bars.tasks[0].completed == 3_000
    assert bars.tasks[0].fields["counts"] == {"docs": 3}


def test_pack_counts_tokens_per_second_without_a_total(bars: Progress, clock: FakeClock) -> None:
    with stage_meter("pack train/s", "tokens") as meter:
        for _ in range(4):
            clock.now += 1.0
            meter.advance(250_000)
        assert "1.0M tokens" in rows(bars)["pack train/s"] and "250k tokens/s" in rows(bars)["pack train/s"]
    with stage_meter("dedupe"):
        clock.now += 2.0
    assert bars.tasks[0].finished and bars.tasks[0].completed == 1_000_000
    assert rows(bars)["dedupe"].endswith("0:02")  # a spinner: just the time it took


def test_a_stage_called_again_or_retried_keeps_its_one_row(bars: Progress) -> None:
    # `tokenmill run` writes the report after prepare and after training; a failed train is retried: each
    # call drew a row of its own, so a stage showed twice ("train (failed)" above "train").
    for _ in range(2):
        with stage_meter("report"):
            pass
    with pytest.raises(OSError), stage_meter("train", "steps", total=10) as meter:
        meter.advance(3)
        raise OSError("the trainer crashed")
    assert rows(bars)["train (failed)"]
    with stage_meter("train", "steps", total=10) as meter:  # the retry
        meter.advance(10)
    open_shared_bar("ingest", "bytes", total=5, num_calls=1)
    with stage_meter("ingest", "bytes") as meter:
        meter.advance(5)
    open_shared_bar("ingest", "bytes", total=7, num_calls=1)  # a second prepare in the same process
    with stage_meter("ingest", "bytes") as meter:
        meter.advance(7)
    assert [task.description for task in bars.tasks] == ["report", "train", "ingest"]
    assert all(task.finished for task in bars.tasks) and bars.tasks[1].completed == 10


def test_an_interrupt_reads_interrupted_not_failed(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    with pytest.raises(KeyboardInterrupt), live_progress(terminal(), get_time=clock) as progress:
        assert progress is not None
        with pytest.raises(KeyboardInterrupt), stage_meter("train", "steps", total=10) as meter:
            meter.advance(4)
            raise KeyboardInterrupt
        with pytest.raises(OSError), stage_meter("dedupe"):
            raise OSError("disk went away")
        open_shared_bar("ingest", "bytes", total=9, num_calls=2)
        with stage_meter("ingest", "bytes") as meter:  # one part done, the other's thread stopped by Ctrl-C
            meter.advance(4)
        raise KeyboardInterrupt
    assert [task.description for task in progress.tasks] == ["train (interrupted)", "dedupe (failed)",
                                                             "ingest (interrupted)"]


def train_row(step: int, loss: float = 3.0, tokens_per_s: float = 41_000.0) -> dict[str, float]:
    return {"step": step, "loss": loss, "lr": 3e-3, "grad_norm": 0.5, "tokens_per_s": tokens_per_s}


def test_training_bar_follows_the_metrics_files(bars: Progress, clock: FakeClock, tmp_path: Path) -> None:
    sink = MetricsSink(RunPaths(tmp_path))  # the trainer's own writer: what it wrote before it was killed
    for step in (50, 100, 110, 130):
        sink.log_train(train_row(step))
    with stage_meter("train", "steps") as meter:
        follower = TrainingFollower(tmp_path / "metrics", [TrainingBar(meter, target_step=200)])
        steps = [lambda: sink.drop_rows_after(100),  # the resumed trainer keeps the rows up to its checkpoint
                 lambda: None,  # it starts training: no row yet
                 lambda: sink.log_train(train_row(110, 3.21, 40_960.0)),
                 lambda: sink.log_train(train_row(120, 3.1, 41_000.0)),
                 lambda: sink.log_eval({"step": 120, "val_loss": 3.3, "val_ppl": 27.11})]
        for write in steps:
            clock.now += 2.0
            write()
            follower.poll()
        row = rows(bars)["train"]
        assert "120/200 steps" in row and "5.0 steps/s" in row and "eta 0:16" in row
        assert "loss 3.1000 · 41,000 tokens/s · val_loss 3.3000" in row
        clock.now += 2.0
        sink.log_train(train_row(200, 2.9, 41_000.0))
        follower.end()
    assert bars.tasks[0].finished and bars.tasks[0].completed == bars.tasks[0].total == 200
    assert "200 steps 10 steps/s 0:10" in rows(bars)["train"]  # 100 steps since the resume, 10 s ago


def test_a_finished_run_shows_nothing_to_train(bars: Progress, tmp_path: Path) -> None:
    sink = MetricsSink(RunPaths(tmp_path))
    sink.log_train(train_row(30))
    with stage_meter("train", "steps") as meter:
        follower = TrainingFollower(tmp_path / "metrics", [TrainingBar(meter, target_step=30)])
        sink.drop_rows_after(30)  # resumed at the last checkpoint, which is the target
        follower.end()
        assert bars.tasks[0].completed == 30 and bars.tasks[0].fields["note"] == "nothing to train"


# ---- tailing one metrics file -------------------------------------------------------------------------


def test_tail_waits_for_the_file_and_for_a_torn_line_to_complete(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "train.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == ([], [])  # no file yet, not even its folder
    path.parent.mkdir()
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
        handle.flush()
        assert tail.poll() == ([], [{"step": 1}])
        assert tail.poll() == ([], [])  # the torn line stays out until its newline arrives
        handle.write('ss": 3.5}\n')
        handle.flush()
        assert tail.poll() == ([], [{"step": 2, "loss": 3.5}])
    tail.close()


def test_tail_skips_the_earlier_runs_rows_and_splits_a_rewrite_into_kept_and_new(tmp_path: Path) -> None:
    sink = MetricsSink(RunPaths(tmp_path))
    for step in (5, 10, 15):  # an attempt killed after its checkpoint at step 10
        sink.log_train(train_row(step))
    tail = MetricsTail(tmp_path / "metrics" / "train.jsonl")
    assert tail.poll() == ([], [])  # the earlier attempt's rows are not this run's progress
    sink.drop_rows_after(10)  # the retry resumes at 10 and drops the row of step 15
    sink.log_train(train_row(15, loss=2.5))  # the replayed step: its row differs from the dropped one
    assert tail.poll() == ([train_row(5), train_row(10)], [train_row(15, loss=2.5)])
    sink.log_train(train_row(20))
    assert tail.poll() == ([], [train_row(20)])
    sink.drop_rows_after(None)  # a fresh start drops every row: nothing kept
    sink.log_train(train_row(5, loss=9.0))
    assert tail.poll() == ([], [train_row(5, loss=9.0)])
    tail.close()


# ---- the numbers come from the files, never from printed lines ----------------------------------------


class RecordingMeter(Meter):
    """A meter without bars that remembers every position and total it was set to."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: list[int] = []
        self.totals: list[int] = []

    def update(self, *, completed: int | None = None, total: int | None = None, note: str | None = None) -> None:
        self.positions += [] if completed is None else [completed]
        self.totals += [] if total is None else [total]

    def restart(self, completed: int) -> None:
        self.positions.append(completed)


FAKE_TRAINER = """
import sys, time
from core.rundir import RunPaths
from trainer.metrics.sink import MetricsSink
sink = MetricsSink(RunPaths(sys.argv[1]))
sink.drop_rows_after(None)
print("step 150/200 | loss 1.0000 | lr 1.00e-03 | grad_norm 0.100 | 9,999 tokens/s", flush=True)  # not in the file
print("training to step 999 on 1 process(es), 4,096 tokens/step", flush=True)
for step in range(20, 201, 20):
    sink.log_train({"step": step, "loss": 2.0, "tokens_per_s": 1000.0})
    time.sleep(0.05)
sink.log_eval({"step": 200, "val_loss": 2.5})
"""


def test_bar_and_artifact_follow_the_jsonl_not_the_printed_lines(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[float] = []
    monkeypatch.setattr(training_progress, "create_progress_artifact", lambda progress, **_: shown.append(progress))
    monkeypatch.setattr(training_progress, "update_progress_artifact", lambda progress, **_: shown.append(progress))
    meter = RecordingMeter()
    lines: list[str] = []
    logger = logging.getLogger("test.fake_trainer")
    watchers = [TrainingBar(meter, 200), TrainingArtifact(200, "run-training-progress")]
    with follow_training(tmp_path / "metrics", watchers, poll_s=0.02):
        run_streaming([sys.executable, "-c", FAKE_TRAINER, str(tmp_path)], logger, deadline_s=60,
                      on_line=lines.append)
    assert any(line.startswith("step 150/200") for line in lines), "the decoy line was printed (and logged)"
    assert meter.positions[-1] == 200 and set(meter.totals) == {200}
    assert set(meter.positions) <= set(range(20, 201, 20)), "a printed step line moved the bar"
    assert shown[-1] == 100.0 and all(percent % 10 == 0 for percent in shown)


def test_no_bars_off_a_terminal_or_when_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = Console(file=io.StringIO(), width=160)
    with live_progress(plain) as progress, stage_meter("pack train/s", "tokens") as meter:
        meter.advance(10)  # a meter without bars does nothing, and does not fail
    assert progress is None and plain.file.getvalue() == ""
    monkeypatch.setenv(QUIET_ENV, "1")
    with live_progress(terminal()) as progress:
        assert progress is None


# ---- the stages' callbacks add up to their summaries --------------------------------------------------


# ---- the real CLI: bars on a terminal, one line per stage elsewhere --------------------------------------


def run_in_pty(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (stdout stays a pipe); returns (status, terminal text, stdout)."""
    main, child = pty.openpty()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    assert process.stdout is not None
    stdout = process.stdout.read().decode()
    return process.wait(timeout=300), b"".join(chunks).decode(errors="replace"), stdout


def cli_env_for() -> dict[str, str]:
    """The session's Prefect test server (no temporary server per command) and a known terminal width."""
    from prefect.settings import PREFECT_API_URL

    env = {key: value for key, value in os.environ.items() if key != QUIET_ENV}
    return {**env, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "120", "TERM": "xterm"}


@pytest.fixture(scope="module")
def cli_env(prefect_server: None) -> dict[str, str]:
    return cli_env_for()


@pytest.mark.slow
def test_prepare_on_a_terminal_shows_bars_with_rates(tmp_path: Path, cli_env: dict[str, str]) -> None:
    recipe = write_small_recipe(tmp_path)
    status, screen, stdout = run_in_pty([TOKENMILL, "prepare", str(recipe), "--run-dir", str(tmp_path / "run")],
                                        cli_env)
    assert status == 0, screen[-3000:]
    summary = json.loads(stdout)
    text = ANSI.sub("", screen)
    final = text[text.rindex("ingest "):]  # the last frame the bars left on screen
    ingest = next(line for line in final.splitlines() if line.startswith("ingest "))
    assert BAR in ingest and " MB/s" in ingest and " records/s)" in ingest
    for split in ("train", "val"):
        pack = next(line for line in final.splitlines() if line.startswith(f"pack {split}/stdlib"))
        assert " tokens " in pack and " tokens/s" in pack
    assert "tokenizer" in final and summary["num_tokens"] > 0
    assert "Task run 'dedupe" in text, "Prefect's log lines still reach the terminal, above the bars"

    quiet, screen, _ = run_in_pty([TOKENMILL, "--quiet", "prepare", str(recipe), "--run-dir", str(tmp_path / "run")],
                                  cli_env)
    assert quiet == 0 and BAR not in screen and "ingest-part:" not in screen and "pack:" not in screen


@pytest.mark.slow
def test_prepare_without_a_terminal_logs_one_line_per_stage(tmp_path: Path, cli_env: dict[str, str]) -> None:
    recipe = write_small_recipe(tmp_path)
    result = subprocess.run([TOKENMILL, "prepare", str(recipe), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, env=cli_env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert BAR not in result.stderr and "\x1b[" not in result.stderr
    lines = result.stderr.splitlines()
    ingest = [line for line in lines if " - ingest part-" in line]  # a line per part, named by its unit
    pack = [line for line in lines if " - pack " in line]
    assert len(ingest) == summary["parts_ingested"] and all(" MB/s)" in line for line in ingest)
    assert len(pack) == 2 and all(" tokens/s" in line for line in pack)  # train and val of the one source
    assert sum(" - tokenizer: " in line for line in lines) == 1


def test_a_skipped_stage_without_counts_says_only_that_it_skipped() -> None:
    assert describe_rates("tokenizer", {"vocab_size": 512, "skipped": True}, 0.001) == "tokenizer: skipped (up to date)"
    assert describe_rates("plan-ingest", [], 0.2) == "plan-ingest: nothing new to do"
