"""``tokenmill status`` on a prepared run lists exactly what ``tokenmill prepare`` then redoes (#35).

One small prepared run (the standard library's json package) and no training: what the status lists is compared
with the units whose markers the re-run really rewrote (the runner writes a unit's marker only when it ran it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.flows.conftest import write_small_recipe

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
NOT_RUN = ["train", "report"]
"""What status lists on a prepared run: training, which no test here runs, and the report that follows it."""


@pytest.fixture
def env(prefect_server: None) -> dict[str, str]:
    """``tokenmill prepare`` against the session's Prefect server (no temporary server per command)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value())}


def tokenmill(*args: str | Path, env: dict[str, str],
              python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The console script run to success (``python_flags``: the interpreter's, e.g. ``-X importtime``)."""
    result = subprocess.run([sys.executable, *python_flags, TOKENMILL, *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def status(*args: str | Path, env: dict[str, str]) -> dict[str, Any]:
    return json.loads(tokenmill("status", *args, "--format", "json", env=env).stdout)


def prepare(recipe: Path, env: dict[str, str]) -> dict[str, Any]:
    """The summary ``tokenmill prepare`` prints."""
    stdout = tokenmill("prepare", recipe, env=env).stdout
    summary, _ = json.JSONDecoder().raw_decode(stdout, stdout.index("{\n"))
    return summary


def markers(run_dir: Path) -> dict[str, tuple[int, int]]:
    """``{"stage" or "stage unit": (inode, mtime)}`` of every unit's marker (not the command seals)."""
    stages = run_dir / "stages"
    found = {}
    for marker in stages.rglob("*.json"):
        stage, _, unit = marker.relative_to(stages).with_suffix("").as_posix().partition("/")
        if stage != "sealed":
            found[f"{stage} {unit}".strip()] = (marker.stat().st_ino, marker.stat().st_mtime_ns)
    return found


def imported_top_level(importtime_log: str) -> set[str]:
    """Top-level package names from ``python -X importtime``'s lines (``import time: self | cumulative | name``)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in importtime_log.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_status_lists_exactly_what_prepare_then_redoes(tmp_path: Path, env: dict[str, str]) -> None:
    recipe = write_small_recipe(tmp_path, packages=("json",))
    run_dir, corpus = tmp_path / "run", tmp_path / "corpus" / "json"
    prepare(recipe, env)

    timed = tokenmill("status", run_dir, recipe, "--format", "json", env=env, python_flags=("-X", "importtime"))
    assert json.loads(timed.stdout)["redo"] == NOT_RUN, "every data stage is done"
    assert "json" in imported_top_level(timed.stderr)
    assert {"torch", "prefect"} & imported_top_level(timed.stderr) == set()
    recorded = status(run_dir, env=env)  # the run as run.yaml records it: no recipe, so no source listing
    assert {"ingest part-00000", "pack split=train/source=stdlib"} <= {
        f"{unit['stage']} {unit['unit']}" for unit in recorded["units"] if unit["state"] == "done"}
    assert recorded["redo"] == NOT_RUN
    assert recorded["notes"] == ["ingest: sources not listed: give the recipe to see new files"]

    ingested = corpus / "decoder.py"  # changed after its part was ingested: not re-read, so only a note
    os.utime(ingested, ns=(ingested.stat().st_atime_ns, ingested.stat().st_mtime_ns + 1_000_000))
    (corpus / "zz_new.py").write_text("def added():\n    return 'a new source file'\n" * 20)
    before = status(run_dir, recipe, env=env)
    new_part = [unit for unit in before["units"] if unit["unit"] == "part-00001"]
    assert new_part == [{"stage": "ingest", "unit": "part-00001", "state": "to do",
                         "reasons": ["new files: json/zz_new.py"]}]
    assert any("json/decoder.py changed after it was ingested; it is not re-read" in note for note in before["notes"])

    markers_before = markers(run_dir)
    summary = prepare(recipe, env)
    redone = sorted(label for label, stat in markers(run_dir).items() if markers_before.get(label) != stat)
    assert summary["parts_ingested"] == 1
    assert sorted(label for label in before["redo"] if label != "train") == redone
    assert {key: summary[key]["skipped"] for key in ("dedupe", "eval_tasks", "decontaminate", "tokenizer")} == {
        key: key.replace("_", "-") not in before["redo"] for key in ("dedupe", "eval_tasks", "decontaminate",
                                                                       "tokenizer")}
    assert status(run_dir, recipe, env=env)["redo"] == NOT_RUN
