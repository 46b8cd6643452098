"""Training progress from the metrics files: the terminal bar and the Prefect artifact follow the trainer's JSONL.

The trainer appends one row to ``metrics/train.jsonl`` per logged step and one to ``metrics/eval.jsonl`` per eval
(trainer/metrics/sink.py, docs/formats.md). :func:`follow_training` tails both while the child runs and hands each new
row to its watchers; the lines the child prints go to the log only, so a change in their wording moves nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.progress.bars import Meter, stage_logger
from flows.report.artifact_keys import artifact_key
from trainer.metrics.sink import EVAL_FILE, TRAIN_FILE

POLL_S = 0.5
"""How often the files are read while the trainer runs; they are read once more when it exits."""

Row = dict[str, Any]


class MetricsTail:
    """The rows a running trainer adds to one metrics file.

    The file as it stands when the tail opens belongs to an earlier run. On start the trainer replaces it
    (``MetricsSink.drop_rows_after``: an atomic rename) by the rows up to the step it resumed from, then
    appends; a file that did not exist is created by its first append. So the leading rows of a replacing file
    that repeat the replaced file's are *kept* rows, the rest are *new* (rows carry wall-clock timings: a
    replayed step's row never repeats the dropped one). A last line without its newline yet waits for it.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._handle: BinaryIO | None = self._open()
        self._pending = b""
        self._rows: list[Row] = self._complete_rows()  # rows of the open file read so far
        self._unmatched: list[Row] = []  # rows of the replaced file a kept row may still repeat, in order

    def poll(self) -> tuple[list[Row], list[Row]]:
        """``(kept, new)``: the rows completed since the last poll, split as described above."""
        kept: list[Row] = []
        new: list[Row] = []
        self._sort(self._complete_rows(), kept, new)
        if (replacement := self._replacement()) is not None:
            self.close()
            self._handle, self._pending = replacement, b""
            self._unmatched, self._rows = self._rows, []
            self._sort(self._complete_rows(), kept, new)
        return kept, new

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _sort(self, rows: list[Row], kept: list[Row], new: list[Row]) -> None:
        for row in rows:
            self._rows.append(row)
            if self._unmatched and self._unmatched[0] == row:
                kept.append(self._unmatched.pop(0))
            else:
                self._unmatched = []
                new.append(row)

    def _open(self) -> BinaryIO | None:
        try:
            return open(self.path, "rb")
        except FileNotFoundError:
            return None

    def _replacement(self) -> BinaryIO | None:
        """The file now at ``path`` when it is not the open one (created or renamed over), else None."""
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return None
        if self._handle is not None:
            current = os.fstat(self._handle.fileno())  # the open handle keeps its inode from being reused
            if (now.st_dev, now.st_ino) == (current.st_dev, current.st_ino):
                return None
        return self._open()

    def _complete_rows(self) -> list[Row]:
        if self._handle is None:
            return []
        lines = (self._pending + self._handle.read()).split(b"\n")
        self._pending = lines.pop()
        return [row for line in lines if (row := _parse_row(line)) is not None]


def _parse_row(line: bytes) -> Row | None:
    """A metrics row, or None for what ``trainer.metrics.sink.read_metric_rows`` skips too (a torn or foreign line)."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


class TrainingWatcher:
    """What follows a training run through its metrics rows; every method does nothing unless overridden."""

    def resumed(self, step: int) -> None:
        """The trainer resumed: it kept the rows up to ``step`` and dropped the later ones."""

    def trained(self, row: Row) -> None:
        """A new ``train.jsonl`` row: ``step``, ``loss``, ``tokens_per_s``, … (docs/training.md)."""

    def evaluated(self, row: Row) -> None:
        """A new ``eval.jsonl`` row: ``step``, ``val_loss``, ``val_ppl``, …"""

    def ended(self, step: int | None, trained_any: bool) -> None:
        """The trainer exited at train row ``step`` (None: no row); ``trained_any``: it appended a train row."""


class TrainingFollower:
    """Tails ``train.jsonl`` and ``eval.jsonl`` of one metrics dir and tells the watchers what changed."""

    def __init__(self, metrics_dir: Path, watchers: Sequence[TrainingWatcher]) -> None:
        self._train, self._eval = MetricsTail(metrics_dir / TRAIN_FILE), MetricsTail(metrics_dir / EVAL_FILE)
        self._watchers = watchers
        self._step: int | None = None
        self._trained_any = False

    def poll(self) -> None:
        kept, new = self._train.poll()
        if kept:
            self._step = kept[-1]["step"]
            self._tell("resumed", self._step)
        for row in new:
            self._step, self._trained_any = row["step"], True
            self._tell("trained", row)
        for row in self._eval.poll()[1]:  # kept eval rows belong to the run resumed from: no note of this run
            self._tell("evaluated", row)

    def end(self) -> None:
        """Read what the exited trainer left, say so, and close the files."""
        try:
            self.poll()
            self._tell("ended", self._step, self._trained_any)
        finally:
            self._train.close()
            self._eval.close()

    def follow(self, stop: threading.Event, poll_s: float) -> None:
        """Poll every ``poll_s`` until ``stop`` is set (the body of the follower thread)."""
        while not stop.wait(poll_s):
            self.poll()

    def _tell(self, event: str, *args: Any) -> None:
        for watcher in self._watchers:
            getattr(watcher, event)(*args)


@contextlib.contextmanager
def follow_training(metrics_dir: Path, watchers: Sequence[TrainingWatcher],
                    poll_s: float = POLL_S) -> Iterator[TrainingFollower]:
    """Feed ``watchers`` from the metrics files while the block runs (start the trainer inside it).

    The files are first read on entry, so rows of an earlier run never count; a thread polls them in a copy of
    the caller's context (the Prefect task run the artifact belongs to). Progress is a side show: an error in it
    is logged as a warning and stops the progress, never the training.
    """
    follower = TrainingFollower(Path(metrics_dir), watchers)
    stop = threading.Event()
    thread = threading.Thread(target=contextvars.copy_context().run, name="training-progress", daemon=True,
                              args=(_warn_on_error, follower.follow, stop, poll_s))
    thread.start()
    try:
        yield follower
    finally:
        stop.set()
        thread.join()
        _warn_on_error(follower.end)


def _warn_on_error(function: Any, *args: Any) -> None:
    try:
        function(*args)
    except Exception as err:  # a progress display must not fail a training run
        stage_logger().warning("training progress stopped following the metrics files: %s: %s",
                               type(err).__name__, err)


class TrainingBar(TrainingWatcher):
    """The terminal's training bar: steps done of ``target_step``; the note shows loss, tokens/s and val_loss.

    A resume restarts the bar's clock at the resumed step, so steps/s and the ETA count only this run's steps.
    """

    def __init__(self, meter: Meter, target_step: int) -> None:
        self._meter, self._target_step = meter, target_step
        self._notes = {"loss": "", "tokens": "", "val_loss": ""}

    def resumed(self, step: int) -> None:
        self._meter.update(total=self._target_step)
        self._meter.restart(step)

    def trained(self, row: Row) -> None:
        self._notes.update(loss=f"loss {_number(row.get('loss'), '.4f')}",
                           tokens=f"{_number(row.get('tokens_per_s'), ',.0f')} tokens/s")
        self._meter.update(completed=row["step"], total=self._target_step, note=self._note())

    def evaluated(self, row: Row) -> None:
        self._notes["val_loss"] = f"val_loss {_number(row.get('val_loss'), '.4f')}"
        self._meter.update(note=self._note())

    def ended(self, step: int | None, trained_any: bool) -> None:
        if not trained_any and step is not None and step >= self._target_step:
            self._meter.update(completed=step, total=self._target_step, note="nothing to train")

    def _note(self) -> str:
        return " · ".join(note for note in self._notes.values() if note)


def _number(value: Any, spec: str) -> str:
    """``value`` as the trainer prints it; a non-finite value is written ``null`` in the file and shown ``nan``."""
    return format(value, spec) if isinstance(value, int | float) else "nan"


class TrainingArtifact(TrainingWatcher):
    """The Prefect progress artifact ``<run>-training-progress``: steps done / ``target_step``, updated every 2%."""

    def __init__(self, target_step: int, key: str) -> None:
        self._target_step, self._key = target_step, key
        self._artifact_id: Any = None
        self._shown = -1.0

    def trained(self, row: Row) -> None:
        percent = 100.0 * row["step"] / max(1, self._target_step)
        if self._artifact_id is None:
            self._artifact_id = create_progress_artifact(progress=percent, key=self._key,
                                                         description="Optimizer steps done / target")
        elif percent - self._shown >= 2.0 or percent >= 100.0:
            update_progress_artifact(artifact_id=self._artifact_id, progress=percent)
        else:
            return
        self._shown = percent



def training_progress(metrics_dir: Path, meter: Meter, target_step: int) -> contextlib.AbstractContextManager[object]:
    """The training bar on ``meter`` and the run's ``training-progress`` artifact, following ``metrics_dir``
    (``RUN/metrics``: the artifact's key is the run dir's, its parent)."""
    key = artifact_key(metrics_dir.parent, "training-progress")
    return follow_training(metrics_dir, [TrainingBar(meter, target_step), TrainingArtifact(target_step, key)])

