"""flows.recipe: loading, run.yaml recording, and refusing a changed data recipe on an existing run dir."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from core.errors import ConfigError
from flows.recipe import changed_data_keys, load_recipe, record_recipe, tokenizer_file
from tests.flows.conftest import write_small_recipe


def test_run_yaml_holds_defaults_mixture_and_no_absolute_paths(tmp_path: Path) -> None:
    recipe, base = load_recipe(write_small_recipe(tmp_path))
    record_recipe(recipe, base, tmp_path / "run")
    recorded = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert recorded["train"]["grad_accum_steps"] == 1 and recorded["dedupe"]["exact"] is True
    assert recorded["mixture"] == {"stdlib": 1.0} and "run_dir" not in recorded
    assert str(tmp_path) not in (tmp_path / "run" / "run.yaml").read_text()


def test_changed_data_section_is_refused_naming_the_keys(tmp_path: Path) -> None:
    path = write_small_recipe(tmp_path)
    recipe, base = load_recipe(path)
    record_recipe(recipe, base, tmp_path / "run")
    data = yaml.safe_load(path.read_text())
    data["pack"]["seq_len"] = 128
    data["train"]["max_steps"] = 99  # training settings may change
    path.write_text(yaml.safe_dump(data))
    changed, _ = load_recipe(path)
    with pytest.raises(ConfigError, match=r"pack\.seq_len\); use another --run-dir"):
        record_recipe(changed, base, tmp_path / "run")
    shutil.rmtree(tmp_path / "run")  # starting fresh, as the message says: delete the run dir
    record_recipe(changed, base, tmp_path / "run")
    assert yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())["pack"]["seq_len"] == 128


def test_keys_added_by_a_later_version_are_not_a_change(tmp_path: Path) -> None:
    recipe, base = load_recipe(write_small_recipe(tmp_path))
    record_recipe(recipe, base, tmp_path / "run")
    run_yaml = tmp_path / "run" / "run.yaml"
    recorded = yaml.safe_load(run_yaml.read_text())
    del recorded["dedupe"]["decontaminate"]  # as written by a version that did not have the key
    run_yaml.write_text(yaml.safe_dump(recorded))
    record_recipe(recipe, base, tmp_path / "run")  # no error: the default is what the old version did
    assert changed_data_keys(recipe, recipe.model_copy(update={"name": "other"})) == []


def recipe_with(tmp_path: Path, **sections: object) -> Path:
    """The small recipe with ``sections`` replaced (None: the section removed)."""
    path = write_small_recipe(tmp_path)
    data = yaml.safe_load(path.read_text())
    for key, value in sections.items():
        data.pop(key) if value is None else data.update({key: value})
    path.write_text(yaml.safe_dump(data))
    return path


def test_no_tokenizer_section_is_allowed_only_with_a_hugging_face_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer: required with the built-in model"):
        load_recipe(recipe_with(tmp_path / "builtin", tokenizer=None))
    for key in ("from_pretrained", "hf_config"):
        path = recipe_with(tmp_path / key, tokenizer=None, model={key: "model"})
        (path.parent / "model").mkdir()
        recipe, base = load_recipe(path)
        assert recipe.tokenizer is None and tokenizer_file(recipe, base) is None
        record_recipe(recipe, base, tmp_path / key / "run")
        assert yaml.safe_load((tmp_path / key / "run" / "run.yaml").read_text())["tokenizer"] is None
        record_recipe(recipe, base, tmp_path / key / "run")  # the recorded recipe compares equal


def test_a_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.from_pretrained: .*nowhere does not exist"):
        load_recipe(recipe_with(tmp_path, tokenizer=None, model={"from_pretrained": "nowhere"}))


def test_tokenizer_vocab_size_with_from_pretrained_is_an_error_naming_both_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.vocab_size cannot be combined with model\.from_pretrained"):
        load_recipe(recipe_with(tmp_path / "a", model={"from_pretrained": "model"}))
    given = recipe_with(tmp_path / "b", model={"from_pretrained": "model"}, tokenizer={"path": "tokenizer.json"})
    (given.parent / "tokenizer.json").write_text("{}")
    (given.parent / "model").mkdir()
    assert load_recipe(given)[0].tokenizer.path == "tokenizer.json"  # a tokenizer of one's own stays allowed
    with_config = recipe_with(tmp_path / "c", model={"hf_config": "config.json"})
    (with_config.parent / "config.json").write_text("{}")
    trained = load_recipe(with_config)[0]
    assert trained.tokenizer.vocab_size == 512  # hf_config has no trained embedding: a new tokenizer may be trained


def test_a_mixture_schedule_replaces_the_manifest_weights_in_run_yaml_and_must_name_their_sources(
        tmp_path: Path) -> None:
    path = write_small_recipe(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["mixture_schedule"] = {"stages": [{"until_step": 10, "weights": {"stdlib": 1}},
                                           {"weights": {"stdlib": 1, "stdlb": 2}}]}
    path.write_text(yaml.safe_dump(data))
    recipe, base = load_recipe(path)
    with pytest.raises(ConfigError, match=r"mixture_schedule.stages\[1\].weights: unknown source\(s\) \['stdlb'\] "
                                          r"\(the manifests name \['stdlib'\]\)"):
        record_recipe(recipe, base, tmp_path / "run")
    data["mixture_schedule"]["stages"][1]["weights"] = {"stdlib": 2}
    path.write_text(yaml.safe_dump(data))
    recipe, base = load_recipe(path)
    record_recipe(recipe, base, tmp_path / "run")
    recorded = yaml.safe_load((tmp_path / "run" / "run.yaml").read_text())
    assert recorded["mixture"] is None  # the trainer refuses run.yaml with both
    assert recorded["mixture_schedule"]["stages"][0] == {"until_step": 10, "weights": {"stdlib": 1.0}}
