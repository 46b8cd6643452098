"""The report of a DPO run: its headline says what it is (the val pairs' DPO loss and reward accuracy), the training's
rewards are plotted over steps, and each checkpoint's reward accuracy per source; a run of another mode shows none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.eval_results import read_result
from core.rundir import RunPaths
from flows.report.artifacts import whole_split_loss
from flows.report.headline import final_val, headline_figures, recorded_train
from flows.report.plots import PLOT_FUNCTIONS, drawn_figure
from flows.report.stage import collect_report_data, write_report
from flows.report.visibility import uninformative_plots
from tests.trainer.eval.conftest import STEPS, ScoredRun

TRAIN_ROWS = [{"step": step, "loss": 0.69 - 0.01 * step, "lr": 1e-5, "tokens_seen": 100 * step, "tokens_per_s": 50.0,
               "rewards/chosen": 0.01 * step, "rewards/rejected": -0.02 * step, "rewards/margin": 0.03 * step,
               "rewards/accuracy": min(1.0, 0.5 + 0.1 * step), "pairs": 8, "pairs_seen": 8 * step}
              for step in range(1, 5)]


@pytest.fixture(scope="module")
def dpo_report(scored_run: ScoredRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "dpo"
    shutil.copytree(scored_run.run_dir, run_dir)
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN_ROWS))
    return run_dir


def test_the_headline_and_plots_of_a_dpo_run(dpo_report: Path) -> None:
    page = write_report(RunPaths(dpo_report))
    html, markdown = page.read_text(), (page.parent / "report.md").read_text()
    data = collect_report_data(dpo_report)
    accuracy = next(row["value"] for row in data["results"] if row["step"] == max(STEPS)
                    and row["task"] == "preference" and row["metric"] == "rewards/accuracy" and row["source"] is None)
    loss = next(row["value"] for row in data["results"] if row["step"] == max(STEPS)
                and row["task"] == "preference" and row["metric"] == "loss" and row["source"] is None)
    assert f"| final val DPO loss | {loss:.4f} | every val pair, step {max(STEPS)} |" in markdown
    assert f"| reward accuracy | {accuracy:.1%} | val pairs whose chosen reward is the higher |" in markdown
    assert "bits per byte" not in markdown.split("### Sample generation")[0]
    assert {path.name for path in page.parent.glob("*.png")} >= {"rewards.png", "preference_eval.png"}
    assert "![DPO rewards in training" in markdown and "not drawn: Full evaluation of a DPO run" not in markdown
    assert "DPO rewards in training" in html and html.count("data:image/png;base64,") == len(list(
        page.parent.glob("*.png")))
    hidden = uninformative_plots(data)
    assert "eval_tasks" in hidden and "eval_sources" in hidden, "the pairs are neither a task nor the token loss"


def test_the_rewards_and_checkpoint_accuracy_plots_draw_what_was_logged(dpo_report: Path) -> None:
    data = collect_report_data(dpo_report)
    with drawn_figure(PLOT_FUNCTIONS["loss"], data, (7, 3.6)) as figure:
        assert figure.axes[0].get_ylabel() == "DPO loss (per pair)"
    with drawn_figure(PLOT_FUNCTIONS["rewards"], data, (7, 5)) as figure:
        rewards, accuracy = figure.axes
        lines = {line.get_label(): list(line.get_ydata()) for line in rewards.get_lines() if
                 not line.get_label().startswith("_")}
        assert set(lines) == {"chosen", "rejected", "margin"}
        for key, values in lines.items():
            assert values == pytest.approx([row[f"rewards/{key}"] for row in TRAIN_ROWS]), key
        assert list(accuracy.get_lines()[0].get_ydata()) == pytest.approx([0.6, 0.7, 0.8, 0.9])
    with drawn_figure(PLOT_FUNCTIONS["preference_eval"], data, (7, 5)) as figure:
        accuracy, loss = figure.axes
        by_label = {line.get_label(): list(line.get_xdata()) for line in accuracy.get_lines()}
        assert by_label == {"all": sorted(STEPS), "code": sorted(STEPS), "qa": sorted(STEPS)}
        assert (accuracy.get_ylabel(), loss.get_ylabel()) == ("reward accuracy", "DPO loss")
    with drawn_figure(PLOT_FUNCTIONS["eval_tasks"], data, (7, 3.6)) as figure:
        assert not figure.axes[0].get_lines(), "the pairs' metrics are no downstream task"


def test_a_run_of_another_mode_hides_the_dpo_plots_and_labels_an_sft_loss() -> None:
    data = {"train": [{"step": 1, "loss": 2.0}], "eval": [{"step": 1, "val_loss": 2.5}], "results": [],
            "funnel": [], "mix": [], "mix_steps": [], "doc_lengths": [], "row_fill": [], "num_packed_pairs": 0}
    hidden = uninformative_plots(data)
    assert "rewards" in hidden and "preference_eval" in hidden
    sft = final_val(data, recorded_train("train:\n  mode: sft\n"))
    assert sft["label"] == "val loss (in-loop subset), assistant tokens"
    assert final_val(data, recorded_train("train: {}"))["label"] == "val loss (in-loop subset)"
    assert final_val(data, recorded_train("chat: {loss: '[b]x'}\ntrain: {mode: sft}"))["label"].endswith(
        ", loss_mask tokens"), "run.yaml is data: an unknown label is not shown"
    dpo = final_val(data, recorded_train("train: {mode: dpo}"))
    assert headline_figures({"val": dpo, "vocab": None, "num_parameters": None, "tokens_trained": None,
                             "tokens_per_char": None})[:2] == [
        ("val DPO loss (in-loop subset)", "2.5000", "in-loop subset of the val pairs, step 1"),
        ("reward accuracy", "—", "not recorded (needs stored reference log-probs)")]


def test_the_run_summarys_final_val_loss_of_a_dpo_run_is_its_val_pairs_dpo_loss(scored_run: ScoredRun) -> None:
    rows = read_result(RunPaths(scored_run.run_dir).eval_result(max(STEPS), "preference"))["rows"]
    loss = next(row["value"] for row in rows if row["metric"] == "loss" and row["source"] is None)
    assert whole_split_loss(scored_run.run_dir) == {"step": max(STEPS), "value": pytest.approx(loss)}
