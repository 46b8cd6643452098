"""``tokenmill status``'s decision: each unit as run_stage would decide it, plus the upstream cascade."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.rundir import RunPaths
from core.stage import Inputs, Progress, Stage, read_marker, run_stage
from flows.status import run_status
from tests.core.test_stage import WordCount


class LongestWord(Stage):
    """Reads word-count's output: its upstream input is word-count's recorded fingerprint."""

    name = "longest-word"
    reads = ("word-count",)

    def inputs(self, unit: str | None) -> Inputs:
        marker = read_marker(self.paths, "word-count")
        return Inputs(upstream={"word-count": marker["fingerprint"] if marker else "missing"})

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.root / "counts" / "longest.txt"]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        words = (self.paths.root / "counts" / "words.json").read_text()
        self.paths.write_text(self.outputs(unit)[0], max(words.split('"')[1::2], key=len))
        return {}


def both(tmp_path: Path, text: str = "a cat sat\n") -> tuple[WordCount, LongestWord]:
    source = tmp_path / "corpus.txt"
    if not source.exists():
        source.write_text(text)
    paths = RunPaths(tmp_path / "run")
    return WordCount(paths, source), LongestWord(paths)


def run_all(stages: tuple[Stage, ...]) -> list[str]:
    """What a re-run really redid: the labels of the units that did not skip."""
    return [stage.label(None) for stage in stages if not run_stage(stage).skipped]


def test_fresh_run_dir_is_all_to_do(tmp_path: Path) -> None:
    status = run_status(both(tmp_path))
    assert [unit.state for unit in status.units] == ["to do", "to do"]
    assert status.redo == ["word-count", "longest-word"]


def test_done_after_a_run(tmp_path: Path) -> None:
    stages = both(tmp_path)
    run_all(stages)
    assert run_status(stages).up_to_date
    assert run_status(stages).rows() == [("word-count", "", "done", ""), ("longest-word", "", "done", "")]


def test_a_changed_file_names_it_and_cascades_exactly(tmp_path: Path) -> None:
    stages = both(tmp_path)
    run_all(stages)
    stages[0].source.write_text("a dog ran\n")
    status = run_status(stages)
    assert status.units[0].reasons == ("file changed: corpus.txt",)
    assert status.units[1].reasons == ("upstream re-runs: word-count",)
    assert status.redo == run_all(stages) == ["word-count", "longest-word"]


def test_a_missing_output_redoes_only_its_unit(tmp_path: Path) -> None:
    stages = both(tmp_path)
    run_all(stages)
    (tmp_path / "run" / "counts" / "words.json").unlink()
    status = run_status(stages)
    assert status.redo == run_all(stages) == ["word-count"]


class Banner(Stage):
    """Reads word-count (a flow orders it after) but its output depends on a setting only, as a tokenizer kept as
    trained does: a re-run of word-count leaves its fingerprint, so the runner skips it."""

    name = "banner"
    reads = ("word-count",)

    def inputs(self, unit: str | None) -> Inputs:
        return Inputs(settings={"text": "hello"})

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.root / "banner.txt"]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        self.paths.write_text(self.outputs(unit)[0], "hello")
        return {}


def test_a_unit_whose_inputs_name_neither_the_rerun_stage_nor_files_stays_done(tmp_path: Path) -> None:
    count, longest = both(tmp_path)
    stages = (count, Banner(count.paths), longest)
    run_all(stages)
    count.source.write_text("a dog ran\n")
    status = run_status(stages)
    assert [unit.state for unit in status.units] == ["stale", "done", "stale"]
    assert status.redo == run_all(stages) == ["word-count", "longest-word"]
