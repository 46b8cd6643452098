"""The evaluation's units as stages: a failed result leaves no marker (the next run tries it again), and the
cached check sees every unit's marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.eval_results import VAL_SPLIT_TASK, read_result
from core.rundir import RunPaths
from core.stage import read_marker, run_stage, stage_status
from trainer.config import EvalConfig
from trainer.eval.stages import DownstreamStage, EvalScope, EvaluationFailed, ExportStage, ValSplitStage

UNIT = "step-0000004"


@pytest.fixture
def scope() -> EvalScope:
    return EvalScope((4,), True, {"tokenmill_next_line": "task-fp"}, EvalConfig(), "fp32", False)


def test_a_damaged_checkpoint_is_a_recorded_failure_and_no_marker(tmp_path: Path, scope: EvalScope) -> None:
    paths = RunPaths(tmp_path)
    folder = paths.checkpoints / UNIT
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")  # no manifest.json: the save did not finish
    stage = ValSplitStage(paths, scope)
    with pytest.raises(EvaluationFailed, match=r"no manifest\.json"):
        run_stage(stage, UNIT)
    failed = read_result(paths.eval_result(4, VAL_SPLIT_TASK))
    assert failed["status"] == "failed" and str(folder) in failed["error"]
    assert read_marker(paths, "evaluate", UNIT) is None
    assert stage_status(stage, UNIT).state == "to do", "the next run evaluates it again"


def test_units_are_named_by_checkpoint_and_task(tmp_path: Path, scope: EvalScope) -> None:
    paths = RunPaths(tmp_path)
    downstream = DownstreamStage(paths, scope)
    assert ValSplitStage(paths, scope).units() == ExportStage(paths, scope).units() == [UNIT]
    assert downstream.units() == [f"{UNIT}/tokenmill_next_line"]
    assert downstream.label(downstream.units()[0]) == "downstream-tokenmill_next_line-step-4"
    assert downstream.bar(downstream.units()[0]) == "tokenmill_next_line step 4"
    assert downstream.outputs(downstream.units()[0]) == [paths.eval_result(4, "tokenmill_next_line")]
    val_split_only = EvalScope((4,), True, {}, EvalConfig(), "fp32", False)
    assert ExportStage(paths, val_split_only).units() == []
