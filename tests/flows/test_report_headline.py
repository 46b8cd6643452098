"""The report's headline over a run with a real export: figures read from the run, a sample made once per export,
and no torch in the report's process unless an export is new."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.rundir import RunPaths
from flows.report.stage import report_is_current, write_report
from tests.conftest import STDLIB, build_query_run
from trainer.model.sample_generation import SAMPLE_SETTINGS

REPO = Path(__file__).resolve().parents[2]
TRAIN_ROWS = [{"step": 1, "loss": 5.0, "lr": 0.1, "tokens_seen": 64, "tokens_per_s": 900.0},
              {"step": 2, "loss": 4.0, "lr": 0.05, "tokens_seen": 320, "tokens_per_s": 950.0}]


def export(run: Path, seed: int) -> int:
    """Export a built-in model (random weights from ``seed``) with the run's tokenizer; returns its parameters."""
    from trainer.config import ModelDims
    from trainer.model.export import export_model, hf_llama_config
    from trainer.model.llama import ModelShape, build_model

    paths = RunPaths(run)
    shape = ModelShape(ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64),
                       vocab_size(run), 32)
    model = build_model(shape, seed=seed)
    export_model(model.state_dict(), hf_llama_config(shape), paths, paths.tokenizer)
    return model.num_parameters()


def vocab_size(run: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(RunPaths(run).tokenizer)).get_vocab_size()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """The hand-built query run (shards of ids 0..15), with metrics and a tokenizer trained on real text."""
    from tokenization.train_tokenizer import train_tokenizer

    run = build_query_run(tmp_path / "run")
    paths = RunPaths(run)
    (run / "metrics" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN_ROWS))
    (run / "metrics" / "eval.jsonl").write_text('{"step": 0, "val_loss": 5.1}\n{"step": 2, "val_loss": 4.25}\n')
    paths.tokenizer.parent.mkdir()
    texts = [path.read_text() for path in sorted((STDLIB / "json").glob("*.py"))]
    train_tokenizer(texts, vocab_size=400).save(str(paths.tokenizer))
    return run


def test_headline_shows_the_runs_own_figures(run: Path) -> None:
    num_parameters = export(run, seed=3)
    html = write_report(RunPaths(run)).read_text()
    headline = html[:html.index("<h2>Data funnel</h2>")]
    size = vocab_size(run)
    for label, value in [("val loss (in-loop subset)", "4.2500"), ("parameters", f"{num_parameters:,}"),
                         ("tokens trained", "320"), ("tokens per character", "2.000"),
                         ("vocab use", f"{16 / size:.1%}")]:
        assert f'<div class="label">{label}</div><div class="value">{value}</div>' in headline, label
    # 16 tokens (ids 0..15, both rows full) over the kept documents' 3 + 5 characters
    assert f"16 of {size:,} ids in the train rows" in headline
    assert ('<div class="value">4.2500</div><div class="note">in-loop subset, step 2; the whole split needs the '
            'full evaluation</div>') in headline
    assert "final val loss" not in headline, "the subset is never called the final val loss"
    assert '<div class="label">bits per byte</div><div class="value">—</div>' in headline
    markdown = (RunPaths(run).report / "report.md").read_text()
    assert ("| val loss (in-loop subset) | 4.2500 | in-loop subset, step 2; the whole split needs the full "
            "evaluation |") in markdown and "### Sample generation" in markdown


def test_the_sample_is_generated_once_per_export_and_shown(run: Path) -> None:
    from trainer.model.generate import generate_text, load_exported_model

    paths = RunPaths(run)
    export(run, seed=3)
    write_report(paths)
    record = json.loads(paths.sample_generation.read_text())
    model, tokenizer, special, context_len = load_exported_model(paths.model)
    expected = generate_text(model, tokenizer, special, context_len, "one", **SAMPLE_SETTINGS)
    assert record["prompt"] == "one"  # the first line of the first kept document (no val split here)
    assert record["prompt"] + record["completion"] == expected and record["completion"]
    html = (paths.report / "index.html").read_text()
    assert f'<pre class="sample"><b>one</b>{_escaped(record["completion"])}</pre>' in html

    made = paths.sample_generation.stat().st_mtime_ns
    write_report(paths)
    assert paths.sample_generation.stat().st_mtime_ns == made and report_is_current(paths)

    export(run, seed=4)  # a new export: not current until sampled again
    assert not report_is_current(paths)
    write_report(paths)
    again = json.loads(paths.sample_generation.read_text())
    assert again["export_fingerprint"] != record["export_fingerprint"]
    assert again["completion"] != record["completion"]
    assert _escaped(again["completion"]) in (paths.report / "index.html").read_text()


def test_an_export_that_does_not_load_is_said_in_the_report(run: Path) -> None:
    paths = RunPaths(run)
    export(run, seed=3)
    (paths.model / "model.safetensors").unlink()
    html = write_report(paths).read_text()
    assert "the exported model did not load: " in html and "model.safetensors" in html


def test_a_truncated_export_is_said_in_the_report(run: Path) -> None:
    paths = RunPaths(run)
    export(run, seed=3)
    weights = paths.model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    html = write_report(paths).read_text()
    assert "the exported model did not load: " in html
    assert '<div class="label">parameters</div><div class="value">—</div>' in html


NO_TORCH_CHECK = """
import sys
from core.rundir import RunPaths
from flows.report.stage import write_report
write_report(RunPaths(sys.argv[1]))
print("torch imported" if "torch" in sys.modules else "no torch")
"""


def report_in_a_fresh_process(run: Path) -> str:
    result = subprocess.run([sys.executable, "-c", NO_TORCH_CHECK, str(run)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=True)
    return result.stdout.strip().splitlines()[-1]


def test_the_report_imports_torch_only_to_sample_a_new_export(run: Path) -> None:
    paths = RunPaths(run)
    assert report_in_a_fresh_process(run) == "no torch"  # no export
    export(run, seed=3)
    assert report_in_a_fresh_process(run) == "torch imported"  # a new export is sampled
    (paths.metrics / "eval.jsonl").write_text('{"step": 2, "val_loss": 4.0}\n')  # the report is redrawn ...
    assert not report_is_current(paths)
    assert report_in_a_fresh_process(run) == "no torch"  # ... from the recorded sample
    assert "4.0000" in (paths.report / "index.html").read_text()


def _escaped(text: str) -> str:
    import html

    return html.escape(text)


def test_files_leading_outside_the_run_dir_are_neither_shown_nor_run(run: Path, tmp_path: Path) -> None:
    import shutil

    paths = RunPaths(run)
    export(run, seed=3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(paths.model, elsewhere / "model")
    paths.model.symlink_to(elsewhere / "model", target_is_directory=True)
    (elsewhere / "versions.json").write_text(json.dumps({"tokenmill": "SECRET-VERSION"}))
    paths.versions.symlink_to(elsewhere / "versions.json")
    (elsewhere / "run.yaml").write_text("password: SECRET-RECIPE\n")
    paths.recipe.symlink_to(elsewhere / "run.yaml")
    html = write_report(paths).read_text()
    assert "SECRET" not in html
    assert not paths.sample_generation.exists(), "a model outside the run dir was loaded"
    assert '<div class="label">parameters</div><div class="value">—</div>' in html
