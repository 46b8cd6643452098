"""The run report: every plot rendered, self-contained HTML that a real headless Chromium loads offline."""

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
from flows.report import MAX_REASONS, PLOT_FUNCTIONS, PLOTS, collect_report_data, write_report
from tests.conftest import build_query_run

CHECK_IMAGES = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const ok = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute("data-images", ok + "/" + images.length);
});
</script></body>"""


TRAIN_ROWS = [  # tokens_seen grows unevenly (as after a batch-size change): the tokens axis must follow it
    {"step": 1, "loss": 5.0, "lr": 0.1, "tokens_seen": 64, "tokens_per_s": 9.0, "mfu": 0.011},
    {"step": 2, "loss": 4.0, "lr": 0.1, "tokens_seen": 128, "tokens_per_s": 9.5, "mfu": 0.012},
    {"step": 3, "loss": 3.5, "lr": 0.1, "tokens_seen": 320, "tokens_per_s": 9.9, "mfu": 0.013},
]


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


def test_report_has_every_plot_and_table(report: Path) -> None:
    html = report.read_text()
    assert html.count("data:image/png;base64,") == len(PLOTS)
    for title in PLOTS.values():
        assert title in html
    assert "Data funnel" in html and "Evaluation" in html and "Checkpoints" in html
    assert "http://" not in html and "https://" not in html, "the page must open offline"
    assert {p.name for p in report.parent.glob("*.png")} == {f"{name}.png" for name in PLOTS}
    assert "| 2 | 4.2 | 66.7 |" in (report.parent / "report.md").read_text()
    assert "Rejected by reason" in html and "<td>invalid_json</td>" in html
    assert "| b | invalid_json | 1 | 50 | the line is not valid JSON |" in (report.parent / "report.md").read_text()


def test_throughput_plot_has_tokens_per_s_and_mfu_with_a_legend(run: Path) -> None:
    figure = draw("throughput", collect_report_data(run))
    try:
        assert legend_labels(figure.axes[0]) == ["tokens/s", "MFU %"]
        assert [round(y, 6) for y in figure.axes[1].get_lines()[0].get_ydata()] == [1.1, 1.2, 1.3]
    finally:
        figure.clear()


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


@pytest.mark.parametrize("contents", ["empty", "data only"])
def test_report_without_training_renders_every_plot_without_warnings(tmp_path: Path, contents: str) -> None:
    run = tmp_path / "run"
    if contents == "empty":
        run.mkdir()
    else:
        shutil.rmtree(build_query_run(run) / "metrics")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = write_report(RunPaths(run))
    assert report.read_text().count("data:image/png;base64,") == len(PLOTS)
    assert {p.name for p in report.parent.glob("*.png")} == {f"{name}.png" for name in PLOTS}


def test_report_renders_in_headless_chromium_with_all_images_loaded(report: Path, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Chromium is required (Debian package `chromium`; .ci/run installs it)"
    page = tmp_path / "check.html"
    page.write_text(report.read_text().replace("</body>", CHECK_IMAGES))
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    match = re.search(r'data-images="(\d+)/(\d+)"', result.stdout)
    assert match, result.stderr[-2000:]
    loaded, total = int(match.group(1)), int(match.group(2))
    assert total == len(PLOTS) and loaded == total
