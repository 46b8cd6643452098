"""Model code a run dir supplies never runs (issue #34, 1): ``model.trust_remote_code: true`` in run.yaml with an
``auto_map`` in ``base_model/config.json`` counts neither for ``tokenmill eval RUN_DIR`` nor for the evaluator and
trainer it launches, which take the launching command's ``--trust-remote-code`` only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from core.code_trust import TRUST_REMOTE_CODE_FLAG
from core.errors import ConfigError
from flows.recipe import resolve_run
from flows.run_code import refuse_untrusted_model_code
from tests.chaos.conftest import tokenmill
from tests.chaos.test_bad_inputs import assert_one_line_error
from tests.chaos.test_run_dir_code import plant_model_code
from tests.trainer.conftest import MakeRunDir
from trainer.eval.checkpoint import main as evaluator_main
from trainer.model.base_model import import_base_model
from trainer.parallel.launch import eval_launch_command, launch_command
from trainer.train import main as trainer_main
from trainer.train import read_trainer_config


def received_remote_code_run(make_run_dir: MakeRunDir, marker: Path) -> Path:
    """A run dir with shards whose run.yaml trusts the remote code its base_model/ brings."""
    run = make_run_dir("received")
    plant_model_code(run / "base_model", marker)
    recipe = yaml.safe_load((run / "run.yaml").read_text())
    recipe["model"] = {"hf_config": "base_model", "trust_remote_code": True}
    recipe["eval"] = {"tasks": []}
    (run / "run.yaml").write_text(yaml.safe_dump(recipe))
    return run


def test_launched_processes_take_the_commands_decision_not_run_yaml(make_run_dir: MakeRunDir, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = received_remote_code_run(make_run_dir, marker)
    assert read_trainer_config(run).model.trust_remote_code is False
    assert read_trainer_config(run, trust_remote_code=True).model.trust_remote_code is True
    assert evaluator_main(["--run-dir", str(run), "--step", "1", "--score"]) == 2
    assert trainer_main(["--run-dir", str(run), "--until-step", "1"]) == 2
    assert not marker.exists()
    assert TRUST_REMOTE_CODE_FLAG not in eval_launch_command(run, 1, 1, score=True, export=False)
    assert TRUST_REMOTE_CODE_FLAG in eval_launch_command(run, 1, 1, score=True, export=False, trust_remote_code=True)
    assert TRUST_REMOTE_CODE_FLAG in launch_command(run, 1, trust_remote_code=True)


def test_eval_of_the_received_run_dir_refuses_its_model_code_in_one_line(make_run_dir: MakeRunDir,
                                                                         tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = received_remote_code_run(make_run_dir, marker)
    (run / "checkpoints" / "step-0000001").mkdir(parents=True)
    assert_one_line_error(tokenmill("eval", run), str(run / "base_model" / "config.json"), "auto_map",
                          "trust_remote_code")
    assert not marker.exists()


def test_a_trusting_recipe_runs_its_own_folders_code_not_the_run_dirs_copy(tmp_path: Path) -> None:
    """``model.trust_remote_code`` in the recipe the user passes trusts the folder that recipe names: other Python
    in a run dir's ``base_model/`` (its stage marker unchanged) is refused before a trainer is launched, and the
    model stage brings the folder in again instead of skipping."""
    marker = tmp_path / "marker"
    plant_model_code(tmp_path / "model", tmp_path / "source-ran")  # the user's own folder: its code may run
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump({"name": "m", "sources": [
        {"name": "s", "path": str(tmp_path), "format": "jsonl", "glob": "*.jsonl"}]}))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "r", "data": {"manifests": ["manifest.yaml"]},
        "model": {"hf_config": "model", "trust_remote_code": True}}))
    run = resolve_run(tmp_path / "recipe.yaml", tmp_path / "received")
    import_base_model(run.paths, tmp_path / "model", run.recipe.model)
    refuse_untrusted_model_code(run)  # base_model/ holds the folder's own code
    planted = run.paths.base_model / "configuration_evil.py"
    planted.unlink()  # a hard link to the user's file: replaced, not written through
    plant_model_code(tmp_path / "other", marker)
    shutil.copyfile(tmp_path / "other" / "configuration_evil.py", planted)
    with pytest.raises(ConfigError, match=r"base_model/configuration_evil\.py: not the file of the model folder"):
        refuse_untrusted_model_code(run)
    assert not import_base_model(run.paths, tmp_path / "model", run.recipe.model)["skipped"]
    refuse_untrusted_model_code(run)
    assert not marker.exists()
