"""The run report: the plots that carry information, self-contained HTML that a real headless Chromium loads
offline and lays out over the whole window."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest

from core.rundir import RunPaths
from flows.report.plots import MAX_REASONS, PLOT_FUNCTIONS, PLOTS, drawn_figure
from flows.report.stage import collect_report_data, write_report
from pipeline.sql.query import realised_mix
from tests.conftest import build_query_run

CHECK_IMAGES = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const ok = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute("data-images", ok + "/" + images.length);
  const boxes = images.map(i => i.getBoundingClientRect());
  const span = Math.max(...boxes.map(b => b.right)) - Math.min(...boxes.map(b => b.left));
  document.body.setAttribute("data-span", Math.round(span) + "/" + window.innerWidth);
});
</script></body>"""
WINDOW_WIDTH_PX = 1600


TRAIN_ROWS = [  # tokens_seen grows unevenly (as after a batch-size change): the tokens axis must follow it
    {"step": 1, "loss": 5.0, "lr": 0.1, "tokens_seen": 64, "tokens_per_s": 900.0, "mfu": 0.011},
    {"step": 2, "loss": 4.0, "lr": 0.1, "tokens_seen": 128, "tokens_per_s": 950.0, "mfu": 0.012},
    {"step": 3, "loss": 3.5, "lr": 0.1, "tokens_seen": 320, "tokens_per_s": 990.0, "mfu": 0.013},
]
SHOWN = {"loss", "throughput", "funnel", "source_mix", "doc_lengths"}
"""The plots that carry information for the ``run`` fixture: two sources, two document lengths; its learning
rate is constant, both packed rows are full, and it has no full evaluation."""


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run = build_query_run(tmp_path / "run")
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN_ROWS))
    (run / "metrics" / "eval.jsonl").write_text('{"step": 0, "val_loss": 5.1, "val_ppl": 164.0}\n'
                                                '{"step": 2, "val_loss": 4.2, "val_ppl": 66.7}\n')
    return run


@pytest.fixture
def report(run: Path) -> Path:
    return write_report(RunPaths(run))


def draw(name: str, data: dict[str, Any]) -> Any:
    """Render one plot the way the report does; returns the matplotlib figure (closed by the caller)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots()
    PLOT_FUNCTIONS[name](axes, data)
    figure.canvas.draw()
    return figure


def legend_labels(axes: Any) -> list[str]:
    return [text.get_text() for text in axes.get_legend().get_texts()]


def test_report_draws_the_plots_with_information_and_says_why_the_others_are_not_drawn(report: Path) -> None:
    html = report.read_text()
    assert html.count("data:image/png;base64,") == len(SHOWN)
    for title in PLOTS.values():
        assert title in html
    assert "Data funnel" in html and "Evaluation" in html and "Checkpoints" in html
    assert "http://" not in html and "https://" not in html, "the page must open offline"
    assert {p.name for p in report.parent.glob("*.png")} == {f"{name}.png" for name in SHOWN}
    assert "Learning rate: the learning rate is constant: 0.1" in html
    assert "Row fill (real tokens per packed row): every packed row holds 8 real tokens" in html
    assert "- not drawn: Learning rate: the learning rate is constant: 0.1" in (report.parent / "report.md").read_text()
    assert "| 2 | 4.2 | 66.7 |" in (report.parent / "report.md").read_text()
    assert "Rejected by reason" in html and "<td>invalid_json</td>" in html
    assert "| b | invalid_json | 1 | 50 | the line is not valid JSON |" in (report.parent / "report.md").read_text()


def test_a_plot_the_data_no_longer_supports_is_removed_with_the_next_report(run: Path) -> None:
    rows = [{**row, "lr": 0.1 * row["step"]} for row in TRAIN_ROWS]
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = write_report(RunPaths(run))
    assert (report.parent / "lr.png").is_file()
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN_ROWS))
    write_report(RunPaths(run))
    assert not (report.parent / "lr.png").exists()
    assert "lr.png" not in (report.parent / "report.md").read_text()


def test_throughput_and_mfu_each_have_a_panel_of_their_own(run: Path) -> None:
    # MFU is tokens/s times a constant: on two y-axes over one panel the MFU line covered the tokens/s line.
    figure = draw("throughput", collect_report_data(run))
    try:
        speed, mfu = figure.axes
        assert [line.get_ydata().tolist() for line in speed.get_lines()] == [[900.0, 950.0, 990.0]]
        assert [[round(y, 6) for y in line.get_ydata()] for line in mfu.get_lines()] == [[1.1, 1.2, 1.3]]
        assert speed.get_ylabel() == "tokens/s" and mfu.get_ylabel() == "MFU (%)"
        top, bottom = speed.get_position(), mfu.get_position()
        assert bottom.y1 <= top.y0, "the panels overlap"
    finally:
        figure.clear()


def test_log_scale_ticks_are_plain_numbers_not_raw_mathtext(run: Path) -> None:
    # With math parsing off (source names are drawn as they are), matplotlib's log tick labels
    # ("$\\mathdefault{10^{1}}$") showed as that raw text on the funnel and the document lengths.
    data = collect_report_data(run)
    data["funnel"] = [{**row, "records_read": 1000, "kept": 990} for row in data["funnel"]]
    for name in ("funnel", "doc_lengths"):
        with drawn_figure(PLOT_FUNCTIONS[name], data, (7, 3.6)) as figure:
            figure.canvas.draw()
            labels = [tick.get_text() for axes in figure.axes for axis in (axes.xaxis, axes.yaxis)
                      for tick in axis.get_ticklabels() if tick.get_text()]
        assert labels and not any("$" in label or "mathdefault" in label for label in labels), (name, labels)
        assert any(label in ("1", "10", "100", "1,000") for label in labels), (name, labels)


def test_loss_plot_tokens_axis_follows_the_logged_tokens_seen(run: Path) -> None:
    figure = draw("loss", collect_report_data(run))
    try:
        axes = figure.axes[0]
        (tokens_axis,) = axes.child_axes
        low, high = axes.get_xlim()
        assert tokens_axis.get_xlabel() == "tokens seen"
        # Past step 3 the axis continues the last step's 192 tokens; step x average tokens/step would give 106.7.
        assert tokens_axis.get_xlim()[1] == pytest.approx(320 + (high - 3) * 192)
        assert tokens_axis.get_xlim()[0] == pytest.approx(low * 64)
    finally:
        figure.clear()


def test_funnel_splits_rejects_by_reason_per_source_and_groups_rare_reasons() -> None:
    funnel = [{"source": s, "records_read": 100, "rejected": 40, "exact_duplicates": 5, "near_duplicates": 1,
               "contaminated": 0, "kept": 54} for s in ("code", "web")]
    reasons = [f"reason_{i:02d}" for i in range(MAX_REASONS + 2)]
    rejects = [{"source": s, "reason": reason, "records": 20 - i} for s in ("code", "web")
               for i, reason in enumerate(reasons)]
    figure = draw("funnel", {"funnel": funnel, "rejects": rejects})
    try:
        stages, by_reason = figure.axes
        assert legend_labels(stages) == ["code", "web"]
        assert legend_labels(by_reason) == [*reasons[:MAX_REASONS - 1], "other (3 reasons)"]
        assert [label.get_text() for label in by_reason.get_yticklabels()] == ["code", "web"]
        widths = [patch.get_width() for patch in by_reason.patches]
        assert sum(widths) == sum(row["records"] for row in rejects)
    finally:
        figure.clear()


@pytest.mark.parametrize(("contents", "shown"), [("empty", set()),
                                                  ("data only", {"funnel", "source_mix", "doc_lengths"})])
def test_report_without_training_draws_only_the_data_plots_without_warnings(tmp_path: Path, contents: str,
                                                                             shown: set[str]) -> None:
    run = tmp_path / "run"
    if contents == "empty":
        run.mkdir()
    else:
        shutil.rmtree(build_query_run(run) / "metrics")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = write_report(RunPaths(run))
    html = report.read_text()
    assert html.count("data:image/png;base64,") == len(shown)
    assert {p.name for p in report.parent.glob("*.png")} == {f"{name}.png" for name in shown}
    assert f"{PLOTS['loss']}: no training metrics yet" in html
    assert "final val loss" in html and "none yet (made from the exported model after training)" in html


def test_report_renders_in_headless_chromium_over_the_window_width_with_all_images_loaded(report: Path,
                                                                                          tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is required (Debian package `chromium`; .ci/run installs it)"
    page = tmp_path / "check.html"
    page.write_text(report.read_text().replace("</body>", CHECK_IMAGES))
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         f"--window-size={WINDOW_WIDTH_PX},1200", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    match = re.search(r'data-images="(\d+)/(\d+)"', result.stdout)
    assert match, result.stderr[-2000:]
    loaded, total = int(match.group(1)), int(match.group(2))
    assert total == len(SHOWN) and loaded == total
    # The plots use the page's width (two columns here), not a 1100 px column in its middle.
    span, width = map(int, re.search(r'data-span="(\d+)/(\d+)"', result.stdout).groups())
    assert width == WINDOW_WIDTH_PX and span > 0.85 * width


def test_the_realised_mix_per_stage_is_queryable_and_plotted_with_its_stage_boundary(run: Path) -> None:
    # Rows as a mixture_schedule run logs them every 2 steps: the row of step 4 holds steps 3 (stage 0) and 4.
    mixes = [[{"stage": 0, "source": "a", "samples": 6}, {"stage": 0, "source": "b", "samples": 2}],
             [{"stage": 0, "source": "a", "samples": 3}, {"stage": 0, "source": "b", "samples": 1},
              {"stage": 1, "source": "a", "samples": 1}, {"stage": 1, "source": "b", "samples": 3}],
             [{"stage": 1, "source": "a", "samples": 2}, {"stage": 1, "source": "b", "samples": 6}]]
    rows = [{**row, "step": 2 * i + 2, "mix": mix} for i, (row, mix) in enumerate(zip(TRAIN_ROWS, mixes, strict=True))]
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert realised_mix(run) == [
        {"stage": 0, "source": "a", "samples": 9, "first_row_step": 2, "last_row_step": 4, "pct_of_stage": 75.0},
        {"stage": 0, "source": "b", "samples": 3, "first_row_step": 2, "last_row_step": 4, "pct_of_stage": 25.0},
        {"stage": 1, "source": "a", "samples": 3, "first_row_step": 4, "last_row_step": 6, "pct_of_stage": 25.0},
        {"stage": 1, "source": "b", "samples": 9, "first_row_step": 4, "last_row_step": 6, "pct_of_stage": 75.0}]
    figure = draw("train_mix", collect_report_data(run))
    try:
        axes = figure.axes[0]
        assert legend_labels(axes) == ["a", "b"]
        (boundary,) = axes.get_lines()
        assert list(boundary.get_xdata()) == [4, 4]
        assert [text.get_text() for text in axes.texts] == ["end of stage 0"]
    finally:
        figure.clear()
    markdown = (write_report(RunPaths(run)).parent / "report.md").read_text()
    assert "train_mix.png" in markdown and "| 1 | b | 9 | 4 | 6 | 75 |" in markdown


def full_eval_rows(steps: list[int]) -> list[dict[str, Any]]:
    """``eval_results`` rows as the report reads them: the whole val split (all sources and two) and one task."""
    rows = []
    for step in steps:
        for source in (None, "code", "web"):
            rows += [{"step": step, "task": "val_split", "metric": "loss", "value": 4.5, "source": source},
                     {"step": step, "task": "val_split", "metric": "bits_per_byte", "value": 1.6, "source": source},
                     {"step": step, "task": "val_split", "metric": "tokens", "value": 900.0, "source": source}]
        rows.append({"step": step, "task": "next_line", "metric": "acc", "value": 0.25, "source": None})
    return rows


def test_full_evaluation_of_one_checkpoint_is_a_marked_point_at_its_step_with_loss_and_bpb_apart() -> None:
    # One checkpoint at step 200 drew a lone point on an axis ticked 192.5 … 207.5, and loss (nats/token) and
    # bits per byte shared one y axis.
    with drawn_figure(PLOT_FUNCTIONS["eval_sources"], {"results": full_eval_rows([200])}, (7, 5)) as figure:
        figure.canvas.draw()
        loss, bpb = figure.axes
        assert (loss.get_ylabel(), bpb.get_ylabel()) == ("loss (nats/token)", "bits per byte")
        assert {tuple(line.get_ydata()) for line in loss.get_lines()} == {(4.5,)}
        assert {tuple(line.get_ydata()) for line in bpb.get_lines()} == {(1.6,)}
        assert legend_labels(loss) == ["all", "code", "web"]
        assert all(line.get_marker() == "o" for axes in (loss, bpb) for line in axes.get_lines())
        assert list(bpb.get_xticks()) == [200] and [t.get_text() for t in bpb.get_xticklabels()] == ["200"]
        assert loss.get_position().y0 >= bpb.get_position().y1, "the panels overlap"
    with drawn_figure(PLOT_FUNCTIONS["eval_tasks"], {"results": full_eval_rows([200])}, (7, 3.6)) as figure:
        figure.canvas.draw()
        (tasks,) = figure.axes
        assert list(tasks.get_xticks()) == [200] and legend_labels(tasks) == ["next_line acc"]

