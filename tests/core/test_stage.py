"""The stage type: one runner that runs, skips, re-runs on a changed input and survives kill -9 between its
outputs and its marker; and the status that says why a unit would be redone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.errors import RunDirError
from core.rundir import RunPaths, file_stats
from core.stage import Inputs, Progress, Stage, read_marker, run_stage, stage_status


class WordCount(Stage):
    """A small stage as a user would add one: counts the words of ``corpus.txt`` into ``counts/words.json``."""

    name = "word-count"

    def __init__(self, paths: RunPaths, source: Path, lowercase: bool = False,
                 kill_before_marker: bool = False) -> None:
        super().__init__(paths)
        self.source, self.lowercase, self.kill_before_marker = source, lowercase, kill_before_marker
        self.runs = 0

    def inputs(self, unit: str | None) -> Inputs:
        return Inputs(settings={"lowercase": self.lowercase},
                      files={stat[0]: stat[2] for stat in file_stats(self.source.parent, self.source)})

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.root / "counts" / "words.json"]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        self.runs += 1
        text = self.source.read_text()
        words = (text.lower() if self.lowercase else text).split()
        self.paths.write_json(self.outputs(unit)[0], {word: words.count(word) for word in sorted(set(words))})
        if self.kill_before_marker:
            os.kill(os.getpid(), signal.SIGKILL)
        on_progress(1, 1)
        return {"num_words": len(words), "num_distinct": len(set(words))}


@pytest.fixture
def stage(tmp_path: Path) -> WordCount:
    source = tmp_path / "corpus.txt"
    source.write_text("The cat saw the cat\n")
    return WordCount(RunPaths(tmp_path / "run"), source)


def test_runs_then_skips(stage: WordCount) -> None:
    first = run_stage(stage)
    second = run_stage(stage)
    assert (first.skipped, second.skipped, stage.runs) == (False, True, 1)
    assert second.summary == first.summary == {"num_words": 5, "num_distinct": 4}
    assert stage_status(stage).state == "done"


def test_changed_input_reruns_and_status_names_it(stage: WordCount) -> None:
    run_stage(stage)
    stage.source.write_text("the dog\n")
    status = stage_status(stage)
    assert (status.state, status.reasons) == ("stale", ("file changed: corpus.txt",))
    assert run_stage(stage).summary == {"num_words": 2, "num_distinct": 2}
    lowercased = WordCount(stage.paths, stage.source, lowercase=True)
    assert stage_status(lowercased).reasons == ("setting changed: lowercase",)


def test_missing_output_reruns(stage: WordCount) -> None:
    run_stage(stage)
    (stage.paths.root / "counts" / "words.json").unlink()
    assert stage_status(stage).reasons == ("output missing: counts/words.json",)
    assert run_stage(stage).skipped is False


def test_never_run_is_to_do(stage: WordCount) -> None:
    assert (stage_status(stage).state, stage_status(stage).reasons) == ("to do", ("never finished",))


KILLED_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from core.rundir import RunPaths
from core.stage import run_stage
from tests.core.test_stage import WordCount
run_stage(WordCount(RunPaths(Path({run!r})), Path({source!r}), kill_before_marker=True))
"""


def test_kill_between_outputs_and_marker_is_redone(stage: WordCount) -> None:
    script = KILLED_RUN.format(tests=str(Path(__file__).parents[2]), run=str(stage.paths.root),
                               source=str(stage.source))
    killed = subprocess.run([sys.executable, "-c", script], check=False)
    assert killed.returncode == -signal.SIGKILL
    output = stage.paths.root / "counts" / "words.json"
    assert output.is_file() and read_marker(stage.paths, stage.name) is None  # the output, no marker
    assert stage_status(stage).state == "to do"
    result = run_stage(stage)
    assert (result.skipped, stage.runs) == (False, 1)
    assert json.loads(output.read_text()) == {"The": 1, "cat": 2, "saw": 1, "the": 1}
    assert run_stage(stage).skipped


def test_a_marker_without_inputs_is_refused_in_one_line(stage: WordCount) -> None:
    stage.paths.write_json(stage.paths.marker(stage.name), {"fingerprint": "0" * 64, "summary": {}})
    with pytest.raises(RunDirError, match=r"word-count\.json: written by an older tokenmill .*--run-dir NEW"):
        run_stage(stage)


def test_upstream_fingerprint_is_an_input(stage: WordCount) -> None:
    assert Inputs(upstream={"ingest": "a"}).fingerprint() != Inputs(upstream={"ingest": "b"}).fingerprint()
    assert Inputs(settings={"x": 1}).fingerprint() == Inputs(settings={"x": 1}).fingerprint()
