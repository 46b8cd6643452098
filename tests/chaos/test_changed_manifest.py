"""Issue 15, item 5: a manifest changed after its run dir was prepared is refused, never silently ignored.

``run.yaml`` records every manifest's resolved content; ``record_recipe`` (the first thing ``prepare`` and
``train`` do) compares it with the current manifests by content, source by source. What may change: a source's
mixture ``weight`` and ``license``, ``on_error`` from fail to skip, new files in a source folder, and where
the recipe and its manifests lie (a copy elsewhere compares equal).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import ConfigError
from flows.recipe import load_recipe, record_recipe
from flows.run_sql import run_query
from tests.chaos.conftest import build_chaos_corpus, file_bytes, run_data_stages, tokenmill, write_chaos_recipe

Manifest = dict[str, Any]


def edit_manifest(root: Path, change: Callable[[Manifest], None], name: str = "manifest.yaml") -> None:
    data = yaml.safe_load((root / name).read_text())
    change(data)
    (root / name).write_text(yaml.safe_dump(data))


def source(data: Manifest, name: str) -> dict[str, Any]:
    return next(item for item in data["sources"] if item["name"] == name)


def recorded(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((run_dir / "run.yaml").read_text())


def record(root: Path, recipe: str = "recipe.yaml") -> None:
    record_recipe(*load_recipe(root / recipe), root / "run")


def refusal(root: Path, recipe: str = "recipe.yaml") -> str:
    """The one-line message of the ConfigError that recording the changed recipe raises."""
    with pytest.raises(ConfigError) as raised:
        record(root, recipe)
    message = str(raised.value)
    assert "\n" not in message and "the recipe changed since this run dir was prepared" in message, message
    assert "another --run-dir" in message, message
    return message


@pytest.fixture
def chaos_root(tmp_path: Path) -> Path:
    """A chaos corpus, recipe and manifest (sources ``code``: text, ``notes``: jsonl) with run.yaml recorded."""
    write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path))
    record(tmp_path)
    return tmp_path


# ---- refused: every key that decides what the documents are ---------------------------------------


def add_source(data: Manifest) -> None:
    data["sources"].append({"name": "extra", "path": source(data, "code")["path"], "format": "text",
                            "glob": "email/*.py"})


CHANGES: dict[str, tuple[Callable[[Manifest], None], str]] = {
    # name: (edit of the manifest, what the message must name)
    "c4-on": (lambda m: m["filters"].update(c4={}), "filters.c4"),  # a filter switched on: values never measured
    "max_chars": (lambda m: m["filters"].update(max_chars=5000), "filters.max_chars"),
    "redact_pii": (lambda m: m["filters"].update(redact_pii=True), "filters.redact_pii"),
    "text_field": (lambda m: source(m, "notes").update(text_field="body"), "sources[notes].text_field"),
    "id_field": (lambda m: source(m, "notes").update(id_field=None), "sources[notes].id_field"),
    "format": (lambda m: source(m, "code").update(format="jsonl"), "sources[code].format"),
    "glob": (lambda m: source(m, "code").update(glob="json/*.py"), "sources[code].glob"),
    "exclude": (lambda m: source(m, "code").update(exclude=["copies/**"]), "sources[code].exclude"),
    "path": (lambda m: source(m, "code").update(path="corpus/text/json"), "sources[code].path"),
    "new-source": (add_source, "sources[extra] (new source)"),
    "removed-source": (lambda m: m.update(sources=[source(m, "code")]), "sources[notes] (removed)"),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_changed_manifest_key_is_refused_naming_corpus_and_key(chaos_root: Path, name: str) -> None:
    change, key = CHANGES[name]
    before = (chaos_root / "run" / "run.yaml").read_bytes()
    edit_manifest(chaos_root, change)
    message = refusal(chaos_root)
    assert f"manifest corpus 'chaos': {key}" in message, message
    assert (chaos_root / "run" / "run.yaml").read_bytes() == before, "a refused recipe is not recorded"


def test_changes_in_both_recipe_and_manifest_are_named_together(chaos_root: Path) -> None:
    edit_manifest(chaos_root, lambda m: (m["filters"].update(max_chars=5000),
                                         source(m, "code").update(glob="json/*.py")))
    data = yaml.safe_load((chaos_root / "recipe.yaml").read_text())
    data["pack"]["seq_len"] = 128
    (chaos_root / "recipe.yaml").write_text(yaml.safe_dump(data))
    message = refusal(chaos_root)
    assert "(pack.seq_len; manifest corpus 'chaos': filters.max_chars, sources[code].glob);" in message, message


def test_a_new_manifest_in_the_recipe_is_refused_as_its_new_sources(chaos_root: Path) -> None:
    (chaos_root / "more.yaml").write_text(yaml.safe_dump(
        {"name": "more", "sources": [{"name": "extra", "path": "corpus/text/email", "format": "text"}]}))
    data = yaml.safe_load((chaos_root / "recipe.yaml").read_text())
    data["data"]["manifests"].append("more.yaml")
    (chaos_root / "recipe.yaml").write_text(yaml.safe_dump(data))
    message = refusal(chaos_root)
    assert "manifest corpus 'more': sources[extra] (new source)" in message and "data.manifests" not in message


def test_on_error_skip_to_fail_is_refused_but_fail_to_skip_is_the_documented_fix(chaos_root: Path) -> None:
    # The "set on_error: skip" remedy of a failed prepare must be accepted on the run dir that failed: under
    # fail, every part that completed read all of its files.
    edit_manifest(chaos_root, lambda m: source(m, "notes").update(on_error="skip"))
    record(chaos_root)
    assert source(recorded(chaos_root / "run")["manifests"][0], "notes")["on_error"] == "skip"
    edit_manifest(chaos_root, lambda m: source(m, "notes").update(on_error="fail"))
    assert "manifest corpus 'chaos': sources[notes].on_error" in refusal(chaos_root)


def test_a_changed_absolute_source_path_is_refused_and_never_written_into_the_run_dir(tmp_path: Path) -> None:
    corpus = build_chaos_corpus(tmp_path)
    write_chaos_recipe(tmp_path, corpus)
    edit_manifest(tmp_path, lambda m: source(m, "code").update(path=str(corpus / "text")))
    record(tmp_path)
    assert str(tmp_path) not in (tmp_path / "run" / "run.yaml").read_text(), "a run dir holds no absolute paths"
    edit_manifest(tmp_path, lambda m: source(m, "code").update(path=str(corpus / "text" / "json")))
    assert "manifest corpus 'chaos': sources[code].path" in refusal(tmp_path)


# ---- accepted: training-side keys, new files, copies ----------------------------------------------


def test_weight_and_license_may_change_and_the_new_mixture_is_recorded(chaos_root: Path) -> None:
    # The trainer reads the mixture from run.yaml at each launch (shards are per source, unweighted; a checkpoint
    # resumes with the new weights from its position on), and no stage reads the licence.
    edit_manifest(chaos_root, lambda m: source(m, "notes").update(weight=3.5, license="CC-BY-4.0"))
    record(chaos_root)
    run_yaml = recorded(chaos_root / "run")
    assert run_yaml["mixture"] == {"code": 1.0, "notes": 3.5}
    assert source(run_yaml["manifests"][0], "notes")["license"] == "CC-BY-4.0"


def test_new_files_in_a_source_folder_are_not_a_change(chaos_root: Path) -> None:
    (chaos_root / "corpus" / "text" / "new_file.py").write_text("print('the nightly refresh adds files')\n")
    record(chaos_root)


def test_renamed_corpus_and_reordered_manifests_are_not_a_change(chaos_root: Path) -> None:
    edit_manifest(chaos_root, lambda m: m.update(name="renamed", sources=m["sources"][::-1]))
    record(chaos_root)


def test_copy_of_run_dir_recipe_and_manifests_elsewhere_is_accepted(chaos_root: Path, tmp_path_factory:
                                                                    pytest.TempPathFactory) -> None:
    copy = tmp_path_factory.mktemp("elsewhere") / "copied"
    shutil.copytree(chaos_root, copy, symlinks=True)
    shutil.rmtree(chaos_root)  # another machine: the original folder is gone
    record(copy)
    edit_manifest(copy, lambda m: m["filters"].update(max_chars=5000))
    assert "filters.max_chars" in refusal(copy), "the copy still knows what it was prepared with"


def test_manifest_moved_with_the_recipe_path_updated_is_accepted(tmp_path: Path) -> None:
    # Manifests are compared by content, not by the recipe's data.manifests strings (refused before: the
    # recipe's data section had changed).
    manifest = {"name": "lib", "sources": [{"name": "stdlib", "path": "${PYTHON_STDLIB}/json", "format": "text",
                                            "glob": "*.py"}]}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(manifest))
    recipe = {"name": "x", "data": {"manifests": ["m.yaml"]}, "tokenizer": {"vocab_size": 512}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    record(tmp_path)
    (tmp_path / "manifests").mkdir()
    (tmp_path / "m.yaml").rename(tmp_path / "manifests" / "lib.yaml")
    recipe["data"]["manifests"] = ["manifests/lib.yaml"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    record(tmp_path)
    assert recorded(tmp_path / "run")["data"]["manifests"] == ["manifests/lib.yaml"]


# ---- accepted: thresholds, re-decided from the stored attributes --------------------------------------


def scramble_keeping_size_and_time(folder: Path) -> None:
    """Every file's bytes replaced by ``#`` (same size and mtime, so planning sees no change): a source read
    again would give other documents (or, for the .gz file, an unreadable_file reject)."""
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            path.write_bytes(b"#" * stat.st_size)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def ingested(run_dir: Path) -> dict[str, str]:
    """``{uri: text}`` of every document the filters kept (duplicates included)."""
    return {row["uri"]: row["text"] for row in run_query(run_dir, "SELECT uri, text FROM _docs").to_pylist()}


def test_a_threshold_change_is_re_decided_from_attributes_and_stages_redo_only_what_changed(tmp_path: Path) -> None:
    recipe = write_chaos_recipe(tmp_path, build_chaos_corpus(tmp_path))
    run = tmp_path / "run"
    run_data_stages(recipe, run)
    first = ingested(run)
    scramble_keeping_size_and_time(tmp_path / "corpus")

    edit_manifest(tmp_path, lambda m: m["filters"].update(min_chars=400))  # accepted: a threshold
    run_data_stages(recipe, run)
    assert recorded(run)["manifests"][0]["filters"]["min_chars"] == 400
    second = ingested(run)
    assert second == {uri: text for uri, text in first.items() if len(text) >= 400} and len(second) < len(first)
    too_short = run_query(run, "SELECT uri, text FROM rejects WHERE reason = 'too_short'").to_pylist()
    assert {row["uri"]: row["text"] for row in too_short} == {uri: first[uri] for uri in first.keys() - second}
    verdicts = run_query(run, "SELECT uri, reason, num_chars FROM attributes WHERE uri IN "
                              "(SELECT uri FROM _docs UNION ALL SELECT uri FROM rejects)").to_pylist()
    assert all((row["reason"] is None) == (row["uri"] in second) for row in verdicts if row["uri"] in first)
    # Packed again from the new documents: no shard row holds a document the filters now reject.
    stale = "SELECT count(*) AS n FROM (SELECT unnest(doc_ids) AS d FROM sequences) WHERE d NOT IN " \
            "(SELECT doc_id FROM _docs)"
    assert run_query(run, stale).to_pylist() == [{"n": 0}]

    # A threshold that changes no verdict: the part markers keep their fingerprints, every later stage is skipped.
    later = file_bytes(run, ("docs/*", "dedupe/*.parquet", "shards/**/*.arrow", "shards/index.parquet",
                             "stages/dedupe.json", "stages/pack/**/*.json"))
    edit_manifest(tmp_path, lambda m: m["filters"].update(min_chars=min(map(len, second.values()))))
    run_data_stages(recipe, run)
    assert file_bytes(run, tuple(later)) == later and ingested(run) == second

    edit_manifest(tmp_path, lambda m: m["filters"].update(min_chars=20))  # relaxed: the texts come back as stored
    run_data_stages(recipe, run)
    assert ingested(run) == first


def test_a_threshold_change_is_refused_where_parts_have_no_attributes(chaos_root: Path) -> None:
    run = chaos_root / "run"
    (run / "docs").mkdir()
    (run / "docs" / "part-00000.parquet").write_bytes(b"")  # ingested by a tokenmill that stored no attributes
    (run / "stages" / "ingest").mkdir(parents=True)
    (run / "stages" / "ingest" / "part-00000.json").write_text("{}")
    edit_manifest(chaos_root, lambda m: m["filters"].update(min_chars=400))
    with pytest.raises(ConfigError) as raised:
        record(chaos_root)
    message = str(raised.value)
    assert "\n" not in message and "manifest corpus 'chaos': filters.min_chars" in message, message
    assert "no attributes/ to re-decide from" in message and "part-00000.parquet" in message, message


# ---- run dirs written before manifests were recorded ----------------------------------------------


def strip_recorded_manifests(run_dir: Path) -> None:
    """Make run.yaml look as a tokenmill that did not record manifests wrote it."""
    data = recorded(run_dir)
    del data["manifests"]
    (run_dir / "run.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_old_run_yaml_is_accepted_with_a_warning_and_its_manifests_recorded(chaos_root: Path) -> None:
    strip_recorded_manifests(chaos_root / "run")
    edit_manifest(chaos_root, lambda m: m["filters"].update(max_chars=5000))  # undetectable: nothing recorded
    with pytest.warns(UserWarning, match="did not record the manifests' content"):
        record(chaos_root)
    assert recorded(chaos_root / "run")["manifests"][0]["filters"]["max_chars"] == 5000
    edit_manifest(chaos_root, lambda m: m["filters"].update(max_chars=6000))
    assert "manifest corpus 'chaos': filters.max_chars" in refusal(chaos_root), "recorded now: later changes seen"


def test_old_run_yaml_still_refuses_a_changed_manifest_list(chaos_root: Path) -> None:
    # Without recorded content the manifests' path strings are all there is to compare (as before).
    strip_recorded_manifests(chaos_root / "run")
    shutil.copyfile(chaos_root / "manifest.yaml", chaos_root / "other.yaml")
    data = yaml.safe_load((chaos_root / "recipe.yaml").read_text())
    data["data"]["manifests"] = ["other.yaml"]
    (chaos_root / "recipe.yaml").write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning):
        assert "data.manifests" in refusal(chaos_root)


def test_manifest_keys_added_by_a_later_version_are_not_a_change(chaos_root: Path) -> None:
    data = recorded(chaos_root / "run")
    del data["manifests"][0]["filters"]["max_symbol_ratio"]  # as written by a version without the key
    del source(data["manifests"][0], "code")["exclude"]
    (chaos_root / "run" / "run.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    record(chaos_root)


def test_garbage_recorded_manifests_are_one_line_naming_run_yaml(chaos_root: Path) -> None:
    data = recorded(chaos_root / "run")
    data["manifests"] = {"not": "a list"}
    (chaos_root / "run" / "run.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError, match=r"run\.yaml: manifests: a list of manifests.*incompatible tokenmill"):
        record(chaos_root)


# ---- through the console script -----------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared_root(tmp_path_factory: pytest.TempPathFactory, cli_env: dict[str, str]) -> Path:
    """A folder with the chaos corpus, recipe, manifest and its run dir prepared once by ``tokenmill prepare``;
    tests work on copies of the whole folder."""
    root = tmp_path_factory.mktemp("changed-manifest")
    write_chaos_recipe(root, build_chaos_corpus(root), train={"max_steps": 10})
    result = tokenmill("prepare", root / "recipe.yaml", "--run-dir", root / "run", env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def run_dir_bytes(run_dir: Path) -> dict[str, bytes]:
    return {path.relative_to(run_dir).as_posix(): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file() and path.name != ".lock"}


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """Exit status 2, no traceback, exactly one ``error:`` line (what a user error looks like)."""
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


CLI_CHANGES = ("max_chars", "text_field", "format", "glob", "new-source")


@pytest.mark.slow
@pytest.mark.parametrize("name", CLI_CHANGES)
def test_prepare_refuses_a_changed_manifest_and_leaves_the_run_dir_alone(
        prepared_root: Path, tmp_path: Path, cli_env: dict[str, str], name: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared_root, copy, symlinks=True)
    before = run_dir_bytes(copy / "run")
    change, key = CHANGES[name]
    edit_manifest(copy, change)
    result = tokenmill("prepare", copy / "recipe.yaml", "--run-dir", copy / "run", env=cli_env)
    line = one_error_line(result)
    assert "the recipe changed since this run dir was prepared" in line, line
    assert f"manifest corpus 'chaos': {key}" in line and "another --run-dir" in line, line
    assert run_dir_bytes(copy / "run") == before, "the run dir is unchanged"


@pytest.mark.slow
def test_prepare_accepts_a_copy_of_run_dir_recipe_and_manifests(
        prepared_root: Path, tmp_path: Path, cli_env: dict[str, str]) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared_root, copy, symlinks=True)
    count = "SELECT count(*) AS n FROM documents"
    result = tokenmill("prepare", copy / "recipe.yaml", "--run-dir", copy / "run", env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_query(copy / "run", count).to_pylist() == run_query(prepared_root / "run", count).to_pylist()
