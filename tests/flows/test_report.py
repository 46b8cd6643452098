"""The run report: every plot rendered, self-contained HTML that a real headless Chromium loads offline."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flows.report import PLOTS, write_report
from tests.conftest import build_query_run

CHECK_IMAGES = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const ok = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute("data-images", ok + "/" + images.length);
});
</script></body>"""


@pytest.fixture
def report(tmp_path: Path) -> Path:
    run = build_query_run(tmp_path / "run")
    (run / "metrics" / "eval.jsonl").write_text('{"step": 0, "val_loss": 5.1, "val_ppl": 164.0}\n'
                                                '{"step": 2, "val_loss": 4.2, "val_ppl": 66.7}\n')
    return write_report(run)


def test_report_has_every_plot_and_table(report: Path) -> None:
    html = report.read_text()
    assert html.count("data:image/png;base64,") == len(PLOTS)
    for title in PLOTS.values():
        assert title in html
    assert "Data funnel" in html and "Evaluation" in html and "Checkpoints" in html
    assert "http://" not in html and "https://" not in html, "the page must open offline"
    assert {p.name for p in report.parent.glob("*.png")} == {f"{name}.png" for name in PLOTS}
    assert "| 2 | 4.2 | 66.7 |" in (report.parent / "report.md").read_text()


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
