"""The one skip-if-done mechanism: every data stage's marker lives under ``stages/``, and a run dir written
before that (markers in ``docs/``, ``dedupe/``, ``tokenizer/``; none for pack) is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.errors import RunDirError
from core.rundir import RunPaths
from pipeline.config import DecontaminateConfig
from pipeline.dedupe.decontaminate import decontaminate_documents
from tests.chaos.conftest import build_chaos_corpus, run_data_stages, write_chaos_recipe

DATA_OUTPUTS = ("docs/*.parquet", "rejects/*.parquet", "dedupe/*.parquet", "dedupe/*/*.parquet",
                "tokenizer/tokenizer.json", "shards/**/*.arrow")
DECONTAMINATE = DecontaminateConfig(enabled=True, ngram=8)


def run_all(root: Path, run_dir: Path) -> dict[str, object]:
    """Every data stage (decontaminate included); returns the decontaminate summary."""
    recipe = write_chaos_recipe(root, root / "corpus")
    run_data_stages(recipe, run_dir)
    with RunPaths(run_dir).lock():
        return decontaminate_documents(RunPaths(run_dir), DECONTAMINATE, base_dir=root)


def stamps(run_dir: Path) -> dict[str, int]:
    return {path.relative_to(run_dir).as_posix(): path.stat().st_mtime_ns
            for pattern in DATA_OUTPUTS for path in sorted(run_dir.glob(pattern))}


def read(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())


def write(path: Path, record: dict[str, object]) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def to_legacy_layout(run_dir: Path) -> None:
    """Rewrite the markers as tokenmill 0.1.0 kept them before ``stages/`` held every one of them."""
    stages = run_dir / "stages"
    for marker in sorted((stages / "ingest").glob("part-*.json")):
        shutil.move(marker, run_dir / "docs" / marker.name)
    dedupe = read(stages / "dedupe.json")
    write(run_dir / "dedupe/state.json", {**read(run_dir / "dedupe/state.json"), **dedupe})
    write(stages / "dedupe.json", {"fingerprint": "the old wrapper's, over decontaminate's settings too",
                                   "summary": dedupe["summary"]})
    write(run_dir / "dedupe/decontaminate.json",
          {**read(run_dir / "dedupe/decontaminate.json"), **read(stages / "decontaminate.json")})
    shutil.move(stages / "tokenizer.json", run_dir / "tokenizer/meta.json")
    (stages / "decontaminate.json").unlink()
    shutil.rmtree(stages / "ingest")
    shutil.rmtree(stages / "pack")


@pytest.mark.slow
def test_markers_live_under_stages_and_an_older_run_dir_is_refused_in_one_line(tmp_path: Path) -> None:
    build_chaos_corpus(tmp_path)
    run_dir = tmp_path / "run"
    run_all(tmp_path, run_dir)
    markers = sorted(path.relative_to(run_dir).as_posix() for path in run_dir.glob("stages/**/*.json"))
    assert {"stages/dedupe.json", "stages/decontaminate.json", "stages/tokenizer.json",
            "stages/ingest/part-00000.json", "stages/pack/split=train/source=code.json"} <= set(markers)
    assert [path.name for path in run_dir.glob("docs/*.json")] == ["plan.json"]  # the plan: state, not a marker
    assert len(stamps(run_dir)) > 20

    to_legacy_layout(run_dir)  # not migrated: refused, saying how to re-run
    with pytest.raises(RunDirError, match=r"stages/dedupe\.json: written by an older tokenmill .*--run-dir NEW") \
            as refused:
        run_all(tmp_path, run_dir)
    assert "\n" not in str(refused.value)
    assert (run_dir / "tokenizer/meta.json").is_file() and (run_dir / "docs/part-00000.json").is_file()
