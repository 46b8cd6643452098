"""Where runs go (docs/architecture.md): the default ``runs/<name>``, a relative ``--run-dir`` and a recipe's relative
``run_dir`` are taken from the folder tokenmill runs in; paths inside the recipe from the recipe's folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.recipe import DEFAULT_RECIPE, manifest_paths, resolve_run

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


def test_run_dirs_are_taken_from_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere, recipes = tmp_path / "elsewhere", tmp_path / "recipes"
    elsewhere.mkdir()
    recipes.mkdir()
    (recipes / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    recipe = {"name": "mine", "run_dir": "out/mine", "data": {"manifests": ["m.yaml"]},
              "tokenizer": {"vocab_size": 300}}
    (recipes / "r.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(elsewhere)
    assert resolve_run(DEFAULT_RECIPE).paths.root == elsewhere / "runs" / "tiny"
    run = resolve_run(Path("../recipes/r.yaml"))
    assert run.paths.root == elsewhere / "out" / "mine"
    assert resolve_run(Path("../recipes/r.yaml"), "given").paths.root == elsewhere / "given"
    assert manifest_paths(run.recipe, run.base) == [recipes / "m.yaml"]


def test_tokenmill_from_another_folder_uses_the_default_recipe_and_runs_there(tmp_path: Path) -> None:
    """Seen through the console script without running a flow: ``runs`` is a file in the working folder, so
    the default run dir there cannot be made, and the one error line names it."""
    (tmp_path / "runs").write_text("a file where the runs folder would go\n")
    result = subprocess.run([TOKENMILL, "prepare"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"error: {tmp_path / 'runs' / 'tiny'}: cannot write there (a part of the path "
                                      "is a file, not a folder); move that file out of the way, or use another run "
                                      "dir (--run-dir).")
