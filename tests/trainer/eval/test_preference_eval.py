"""A DPO run's per-checkpoint evaluation: every pair of both splits scored under the checkpoint (the values each pair
has alone), the val pairs' DPO loss and rewards as its ``preference`` result, and the stage that runs it in place
of the val split's token loss."""

from __future__ import annotations

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
from trainer.eval.preference import val_result_rows
from trainer.eval.preference_stage import PreferenceEvalStage
from trainer.eval.run_mode import dpo_settings
from trainer.eval.stages import EvalScope, EvaluationFailed, ValSplitStage
from trainer.parallel.launch import eval_launch_command


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


def test_without_a_reference_only_log_probs_and_simpo_needs_none(scored_run: ScoredRun, tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)  # no reference/ here: precompute false
    step = max(STEPS)
    table = pq.read_table(RunPaths(scored_run.run_dir).preference_scores(step))
    sigmoid = val_result_rows(paths, table, dpo_settings(SimpleNamespace(mode="dpo")))
    assert {row["metric"] for row in sigmoid} == {"logps/chosen", "logps/rejected"}
    simpo = dpo_settings(SimpleNamespace(mode="dpo", dpo={"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.3}))
    got = {row["metric"]: row["value"] for row in val_result_rows(paths, table, simpo) if row["source"] is None}
    val = [(doc_id, pair) for doc_id, (split, _, pair) in scored_run.pairs.items() if split == "val"]
    chosen = np.array([scored_run.expected[step][d][0] / pair.chosen.num_loss_tokens for d, pair in val])
    rejected = np.array([scored_run.expected[step][d][1] / pair.rejected.num_loss_tokens for d, pair in val])
    logits = 2.0 * (chosen - rejected) - 0.3
    assert got["loss"] == pytest.approx(float(np.mean(np.log1p(np.exp(-logits)))), abs=1e-5)
    assert got["rewards/chosen"] == pytest.approx(float(np.mean(2.0 * chosen)), abs=1e-5)
    assert got["rewards/accuracy"] == pytest.approx(float(np.mean(chosen > rejected)))
