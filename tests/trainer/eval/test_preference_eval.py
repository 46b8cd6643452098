"""A DPO run's per-checkpoint evaluation: every pair of both splits scored under the checkpoint (the values each pair
has alone), the val pairs' DPO loss and rewards as its ``preference`` result, and the stage that runs it in place
of the val split's token loss."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.eval_results import PREFERENCE_SCORES_SCHEMA, PREFERENCE_TASK, all_rows, read_result
from core.rundir import RunPaths
from core.stage import read_marker, run_stage, stage_status
from tests.trainer.eval.conftest import BETA, STEPS, ScoredRun
from trainer.config import EvalConfig
from trainer.eval.loss_masks import dpo_settings
from trainer.eval.preference import read_pair_rows
from trainer.eval.preference_stage import PreferenceEvalStage
from trainer.eval.stages import EvalScope, EvaluationFailed, ValSplitStage
from trainer.parallel.launch import eval_launch_command, launch_command

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_every_pair_of_both_splits_is_scored_as_it_scores_alone(scored_run: ScoredRun) -> None:
    for step in STEPS:
        table = pq.read_table(RunPaths(scored_run.run_dir).preference_scores(step))
        assert table.schema.equals(PREFERENCE_SCORES_SCHEMA)
        rows = {row["doc_id"]: row for row in table.to_pylist()}
        assert sorted(rows) == sorted(scored_run.pairs), "each pair once, train and val"
        for doc_id, (split, source, pair) in scored_run.pairs.items():
            row = rows[doc_id]
            assert (row["step"], row["split"], row["source"]) == (step, split, source)
            assert (row["chosen_tokens"], row["rejected_tokens"]) == (pair.chosen.num_loss_tokens,
                                                                      pair.rejected.num_loss_tokens)
            chosen, rejected = scored_run.expected[step][doc_id]
            assert row["chosen_logp"] == pytest.approx(chosen, abs=1e-4)
            assert row["rejected_logp"] == pytest.approx(rejected, abs=1e-4)


def expected_result(scored_run: ScoredRun, step: int, source: str | None) -> dict[str, float]:
    """The val pairs' sigmoid DPO by hand (numpy, float64) from the pairs' log-probs alone."""
    ids = [doc_id for doc_id, (split, name, _) in scored_run.pairs.items()
           if split == "val" and source in (None, name)]
    policy = np.array([scored_run.expected[step][doc_id] for doc_id in ids])
    reference = np.array([scored_run.expected[0][doc_id] for doc_id in ids])
    chosen, rejected = BETA * (policy[:, 0] - reference[:, 0]), BETA * (policy[:, 1] - reference[:, 1])
    return {"loss": float(np.mean(np.log1p(np.exp(-(chosen - rejected))))),
            "rewards/chosen": float(chosen.mean()), "rewards/rejected": float(rejected.mean()),
            "rewards/accuracy": float(np.mean(chosen > rejected)), "rewards/margin": float(np.mean(chosen - rejected)),
            "logps/chosen": float(policy[:, 0].mean()), "logps/rejected": float(policy[:, 1].mean()),
            "pairs": len(ids)}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_the_val_pairs_dpo_loss_and_rewards_are_the_checkpoints_result(scored_run: ScoredRun, step: int) -> None:
    paths = RunPaths(scored_run.run_dir)
    result = read_result(paths.eval_result(step, PREFERENCE_TASK))
    assert result["status"] == "ok", result["error"]
    rows = [row for row in all_rows(paths) if row["step"] == step and row["task"] == PREFERENCE_TASK]
    for source in (None, "code", "qa"):
        expected = expected_result(scored_run, step, source)
        got = {row["metric"]: row for row in rows if row["source"] == source}
        assert set(got) == set(expected) - {"pairs"}, source
        for metric, row in got.items():
            assert row["value"] == pytest.approx(expected[metric], abs=1e-4), (source, metric)
            assert row["num_samples"] == expected["pairs"]
    assert 0 < expected_result(scored_run, step, None)["rewards/accuracy"] < 1, "the data shows both cases"


def scope(dpo: dict | None, steps: tuple[int, ...] = (4,)) -> EvalScope:
    return EvalScope(steps, True, {}, EvalConfig(), "fp32", False, dpo=dpo)


def test_a_dpo_run_scores_pairs_in_place_of_the_val_splits_token_loss(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    settings = dpo_settings(SimpleNamespace(mode="dpo"))
    assert PreferenceEvalStage(paths, scope(settings)).units() == ["step-0000004"]
    assert ValSplitStage(paths, scope(settings)).units() == []
    assert PreferenceEvalStage(paths, scope(None)).units() == []
    assert ValSplitStage(paths, scope(None)).units() == ["step-0000004"]
    assert PreferenceEvalStage(paths, scope(settings)).outputs("step-0000004") == [
        paths.preference_scores(4), paths.eval_result(4, PREFERENCE_TASK)]


def test_a_new_beta_or_reference_rescores_the_checkpoint(scored_run: ScoredRun) -> None:
    paths = RunPaths(scored_run.run_dir)
    settings = dpo_settings(SimpleNamespace(mode="dpo", dpo=SimpleNamespace(beta=BETA)))
    stage = PreferenceEvalStage(paths, scope(settings, (2,)))
    inputs = stage.inputs("step-0000002")
    assert inputs.settings["beta"] == BETA
    assert any("reference/split=val/source=qa.parquet" in name for name in inputs.files)
    other_beta = PreferenceEvalStage(paths, scope({**settings, "beta": 0.5}, (2,))).inputs("step-0000002")
    assert other_beta.fingerprint() != inputs.fingerprint()
    assert stage_status(stage, "step-0000002").state == "to do", "never run by the stage: no marker"


def test_dpo_settings_are_read_with_the_defaults_and_only_for_dpo() -> None:
    assert dpo_settings(SimpleNamespace(mode="sft")) is None and dpo_settings(SimpleNamespace()) is None
    assert dpo_settings(SimpleNamespace(mode="dpo")) == {"beta": 0.1, "label_smoothing": 0.0, "loss": "sigmoid",
                                                         "simpo_gamma": 0.5}
    unset = SimpleNamespace(beta=0.2, label_smoothing=0.0, loss="sigmoid", simpo_gamma=None)  # trainer.config's
    assert dpo_settings(SimpleNamespace(mode="dpo", dpo=unset))["simpo_gamma"] == 0.5
    section = SimpleNamespace(beta=0.3, label_smoothing=0.1, loss="simpo", simpo_gamma=1.0)
    assert dpo_settings(SimpleNamespace(mode="dpo", dpo=section)) == {"beta": 0.3, "label_smoothing": 0.1,
                                                                      "loss": "simpo", "simpo_gamma": 1.0}


def test_two_processes_score_every_pair_as_one_does(scored_run: ScoredRun, tmp_path: Path) -> None:
    """Each process scores a share of the rows (the shares hold different numbers of pairs) and the main one writes
    them all, in the order one process gives."""
    run_dir = tmp_path / "copy"
    shutil.copytree(scored_run.run_dir, run_dir)
    step, seed = next(iter(STEPS.items()))
    argv = launch_command(run_dir, 2, module="tests.trainer.eval.two_process_scores",
                          module_args=["--step", "99", "--seed", str(seed)])
    completed = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    paths = RunPaths(run_dir)
    pairs_per_row = [len(pairs) for pairs in read_pair_rows(paths).pair_doc_ids]
    assert sum(pairs_per_row[:len(pairs_per_row) // 2]) != sum(pairs_per_row[len(pairs_per_row) // 2:])
    two = pq.read_table(paths.preference_scores(99)).drop_columns(["step"])
    one = pq.read_table(paths.preference_scores(step)).drop_columns(["step"])
    assert two.column("doc_id").to_pylist() == one.column("doc_id").to_pylist()
    for name in ("chosen_logp", "rejected_logp"):
        assert np.allclose(two.column(name).to_numpy(), one.column(name).to_numpy(), rtol=0, atol=1e-6)
    assert two.select(["split", "source", "chosen_tokens", "rejected_tokens"]).equals(
        one.select(["split", "source", "chosen_tokens", "rejected_tokens"]))
    two_rows, one_rows = (read_result(paths.eval_result(at, PREFERENCE_TASK))["rows"] for at in (99, step))
    assert [(row["metric"], row["source"]) for row in two_rows] == [(row["metric"], row["source"]) for row in one_rows]
    assert [row["value"] for row in two_rows] == pytest.approx([row["value"] for row in one_rows], abs=1e-5)


def test_a_damaged_checkpoint_is_a_recorded_preference_failure_and_no_marker(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    folder = paths.checkpoint(4)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights")  # no manifest.json: the save did not finish
    stage = PreferenceEvalStage(paths, scope(dpo_settings(SimpleNamespace(mode="dpo"))))
    with pytest.raises(EvaluationFailed, match=r"preference @ step 4: .*no manifest\.json"):
        run_stage(stage, "step-0000004")
    failed = read_result(paths.eval_result(4, PREFERENCE_TASK))
    assert failed["status"] == "failed" and str(folder) in failed["error"]
    assert read_marker(paths, "evaluate-pairs", "step-0000004") is None
    assert stage_status(stage, "step-0000004").state == "to do", "the next run scores it again"


def test_the_unit_launches_the_checkpoint_evaluator_to_score_pairs() -> None:
    from trainer.eval.checkpoint import parse_args

    argv = eval_launch_command(Path("runs/dpo"), 2, 4, score=False, export=False, pairs=True)
    flags = argv[argv.index("trainer.eval.checkpoint") + 1:]
    args = parse_args(flags)
    assert (args.step, args.pairs, args.score, args.export) == (4, True, False, False)
    assert "--pairs" not in eval_launch_command(Path("runs/dpo"), 2, 4, score=True, export=False)
