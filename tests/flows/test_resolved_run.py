"""The run is resolved once: an entry reads the recipe, and the flows it starts use what it read.

Shown without counting calls: the recipe file is broken after resolving, and the flow still runs from the
resolved run (a flow that read the file again would fail on it). Starting a flow by path, as a deployment does, is
what the other flow tests do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.recipe import as_resolved, resolve_run
from tests.flows.conftest import write_small_recipe


def test_a_resolved_run_is_used_as_it_is_and_a_path_is_read(tmp_path: Path) -> None:
    recipe = write_small_recipe(tmp_path)
    run = resolve_run(recipe, tmp_path / "elsewhere")
    assert run.paths.root == (tmp_path / "elsewhere").resolve() and run.base == tmp_path.resolve()
    recipe.write_text("not: [a recipe")
    assert as_resolved(run) is run
    with pytest.raises(ValueError, match="already resolved"):
        as_resolved(run, str(tmp_path / "other"))


def test_prepare_data_runs_from_the_resolved_run_without_reading_the_recipe_again(
        tmp_path: Path, prefect_server: None) -> None:
    from flows.pipeline import prepare_data

    recipe = write_small_recipe(tmp_path, packages=("json",))
    run = resolve_run(recipe, tmp_path / "resolved-run")
    recipe.write_text("not: [a recipe")  # any later read of the file fails
    summary = prepare_data(run)
    assert summary["run_dir"] == str(run.paths.root) and summary["num_shards"] > 0
    recorded = yaml.safe_load(run.paths.recipe.read_text())
    assert recorded["name"] == run.recipe.name and recorded["tokenizer"]["vocab_size"] == 512
    assert not (tmp_path / "run").exists()  # the recipe's own run_dir: --run-dir was resolved once, kept

