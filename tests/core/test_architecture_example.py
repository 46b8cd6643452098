"""docs/architecture.md, "How to add a stage": the worked example is real. Its stage module and its layout entry,
run as written on a small run dir, give a stage that runs, skips, and re-runs when an input file changes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from core.rundir import RunPaths
from core.stage import Stage, run_stage, stage_status
from tests.conftest import build_query_run

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def example_blocks() -> list[str]:
    """The ```python blocks of the section "How to add a stage", in order: the module, the layout entry, …"""
    section = ARCHITECTURE.read_text(encoding="utf-8").split("\n## How to add a stage\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def example_stage(run_dir: Path) -> Stage:
    """The documented stage class, built on a RunPaths that has the documented layout entry."""
    module, layout, *_ = example_blocks()
    namespace: dict[str, Any] = {"RunPaths": RunPaths, "Path": Path}
    exec(compile(module, "pipeline/doc_lengths.py", "exec"), namespace)  # our own docs, not run-dir data
    exec(compile("class ExamplePaths(RunPaths):\n" + layout, "core/layout.py", "exec"), namespace)
    stage_class = next(value for value in namespace.values()
                       if isinstance(value, type) and issubclass(value, Stage) and value is not Stage)
    return stage_class(namespace["ExamplePaths"](run_dir))


def test_the_worked_example_runs_skips_and_reruns_on_a_changed_input(tmp_path: Path) -> None:
    stage = example_stage(build_query_run(tmp_path / "run"))  # documents 1-3; dedupe removed document 2
    first = run_stage(stage)
    table = json.loads(stage.paths.doc_lengths.read_text())
    assert (first.skipped, first.summary) == (False, {"num_documents": 2})
    assert table == {"train/a": {"documents": 1, "median_chars": 3, "max_chars": 3},
                     "train/b": {"documents": 1, "median_chars": 5, "max_chars": 5}}
    assert run_stage(stage).skipped and stage_status(stage).state == "done"
    part = stage.paths.docs / "part-00000.parquet"
    pq.write_table(pq.read_table(part).slice(0, 2), part)  # document 3 (source b) is gone
    assert stage_status(stage).reasons == ("file changed: docs/part-00000.parquet",)
    again = run_stage(stage)
    assert (again.skipped, again.summary) == (False, {"num_documents": 1})
    assert list(json.loads(stage.paths.doc_lengths.read_text())) == ["train/a"]
