"""A trained DPO run's checkpoint evaluated as ``tokenmill eval`` does it: the ``evaluate-pairs`` unit launches
``trainer.eval.checkpoint --pairs`` on 2 processes (the checkpoint was trained on 1), and its DPO result equals the
training loop's own evaluation of the same val pairs (the in-loop subset made as large as the split)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from core.eval_results import PREFERENCE_TASK, read_result
from core.rundir import RunPaths
from core.stage import run_stage, stage_status
from flows.run_sql import run_query
from tests.trainer.conftest import Corpus
from tests.trainer.preference_run import make_preference_run_dir
from trainer.config import EvalConfig
from trainer.eval.preference import read_pair_rows
from trainer.eval.preference_stage import PreferenceEvalStage
from trainer.eval.run_mode import dpo_settings
from trainer.eval.stages import EvalScope
from trainer.metrics.sink import read_metric_rows
from trainer.run_config import read_trainer_config
from trainer.train import main

STEP = 2


def test_a_checkpoint_scored_on_two_processes_is_what_the_loop_measured(tmp_path: Path,
                                                                         stdlib_corpus: Corpus) -> None:
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, dpo={"beta": 0.2}, max_steps=STEP,
                                      checkpoint_every=STEP, eval_every=STEP, eval_batches=64)
    assert main(["--run-dir", str(run_dir)]) == 0
    paths, train = RunPaths(run_dir), read_trainer_config(run_dir).train
    scope = EvalScope((STEP,), True, {}, EvalConfig(), train.precision, train.document_masking, num_processes=2,
                      dpo=dpo_settings(train))
    stage = PreferenceEvalStage(paths, scope)
    with paths.lock():  # as the flow holds it: the launched evaluator shares it
        run_stage(stage, stage.units()[0])
    assert stage_status(stage, stage.units()[0]).state == "done"
    result = read_result(paths.eval_result(STEP, PREFERENCE_TASK))
    overall = {row["metric"]: row for row in result["rows"] if row["source"] is None}
    in_loop = next(row for row in read_metric_rows(paths.eval_metrics) if row["step"] == STEP)
    assert overall["loss"]["num_samples"] == in_loop["val_pairs"], "the loop scored every val pair"
    assert overall["loss"]["value"] == pytest.approx(in_loop["val_loss"], abs=1e-5)
    for metric in ("rewards/accuracy", "rewards/margin", "rewards/chosen", "rewards/rejected"):
        assert overall[metric]["value"] == pytest.approx(in_loop[metric], abs=1e-5), metric
    scores = pq.read_table(paths.preference_scores(STEP))
    assert scores.num_rows == sum(len(pairs) for pairs in read_pair_rows(paths).pair_doc_ids)
    view = run_query(run_dir, "SELECT count(*) AS pairs, count(reference_chosen_logp) AS referenced, "
                              "avg(prefers_chosen::INTEGER) AS accuracy FROM preference_pairs "
                              f"WHERE split = 'val' AND step = {STEP}").to_pylist()[0]
    assert view["pairs"] == view["referenced"] == in_loop["val_pairs"]
    assert view["accuracy"] == pytest.approx(in_loop["rewards/accuracy"], abs=1e-9)
