"""Names and run dirs are checked against the file system's limits where they enter, before any work, and a
folder where a run's file must be is one line naming it (issue #34, class 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.errors import ConfigError, ManifestError, UnwritableError
from core.files.path_limits import LAYOUT_DEPTH_BYTES, MAX_NAME_BYTES, NAME_MAX_BYTES, PATH_MAX_BYTES
from core.rundir import RunPaths
from flows.recipe import load_recipe
from pipeline.manifest import load_manifest


def write_manifest(root: Path, source: str = "s", corpus: str = "m") -> Path:
    (root / "corpus").mkdir(exist_ok=True)
    (root / "corpus" / "a.txt").write_text("A small document, long enough to pass the quality filters.\n")
    path = root / "m.yaml"
    path.write_text(yaml.safe_dump({"name": corpus, "sources": [{"name": source, "path": "corpus",
                                                                 "format": "text"}]}))
    return path


@pytest.mark.parametrize("key", ["source", "corpus"])
def test_a_manifest_name_longer_than_its_file_names_allow_is_refused_naming_key_and_limit(tmp_path: Path,
                                                                                          key: str) -> None:
    path = write_manifest(tmp_path, **{key: "s" * 260})
    with pytest.raises(ManifestError) as refused:
        load_manifest(path)
    line = str(refused.value)
    assert "\n" not in line and f"{path}: " in line
    assert ("sources.0.name" if key == "source" else ": name:") in line
    assert f"is 260 characters, above the {MAX_NAME_BYTES}" in line and f"{NAME_MAX_BYTES} bytes" in line


def test_a_recipe_name_too_long_for_its_run_dir_is_refused_naming_it(tmp_path: Path) -> None:
    write_manifest(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "n" * 300, "data": {"manifests": ["m.yaml"]},
                                      "tokenizer": {"vocab_size": 512}}))
    with pytest.raises(ConfigError, match=rf"{recipe}: name: 'n+…n+' is 300 characters, above the {MAX_NAME_BYTES}"):
        load_recipe(recipe)


def test_the_longest_name_allowed_fits_every_file_the_layout_makes_of_it(tmp_path: Path) -> None:
    """The limit is right, not only low: a source name of MAX_NAME_BYTES makes its shard folder and pack marker."""
    write_manifest(tmp_path, source="s" * MAX_NAME_BYTES)
    name = load_manifest(tmp_path / "m.yaml").sources[0].name
    paths = RunPaths(tmp_path / "run")
    paths.write_json(paths.marker("pack", f"split=train/source={name}"), {"fingerprint": "f"})  # the longest
    paths.write_bytes(paths.shards / "split=train" / f"source={name}" / "part-00000.arrow", b"x")
    assert paths.marker("pack", f"split=train/source={name}").is_file()


@pytest.mark.parametrize("shape", ["a folder name of 300 bytes", "a whole path past PATH_MAX's room"])
def test_a_run_dir_too_long_for_the_file_system_is_one_line_before_any_work(tmp_path: Path, shape: str) -> None:
    if shape == "a folder name of 300 bytes":
        run_dir, says = tmp_path / ("r" * 300), "is 300 bytes; a file system allows"
    else:
        depth = (PATH_MAX_BYTES - LAYOUT_DEPTH_BYTES) // 200 + 1
        run_dir, says = tmp_path.joinpath(*["d" * 199] * depth), f"at most {PATH_MAX_BYTES - 1 - LAYOUT_DEPTH_BYTES}"
    with pytest.raises(ConfigError) as refused:
        RunPaths(run_dir)
    assert says in str(refused.value) and "use a shorter run dir (--run-dir)" in str(refused.value)
    assert not any(tmp_path.iterdir()), "nothing was made"


def test_a_folder_where_a_run_file_must_be_is_an_unwritable_error_naming_it(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    (paths.recipe / "inside").mkdir(parents=True)
    with pytest.raises(UnwritableError) as refused:
        paths.write_text(paths.recipe, "name: x\n")
    assert str(refused.value).startswith(f"{paths.recipe}: cannot write there (a folder is in the way")
    assert "move that folder out of the way" in str(refused.value)
    assert [entry.name for entry in paths.root.iterdir()] == ["run.yaml"], "no temporary file is left"
