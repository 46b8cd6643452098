"""A command's seal (flows.up_to_date) holds only while nothing its stages read has changed.

In-process and without Prefect: the seal is written over a run dir in whatever state, then each kind of input
is changed and put back. The commands themselves (a seal written by a run that did the work, the skipped
summary equal to a skipped flow's) are run in tests/test_readme_commands.py on the quick start's run.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from flows.recipe import ResolvedRun, resolve_run
from flows.up_to_date import as_skipped, sealed_summary, write_seal
from tests.flows.conftest import write_small_recipe

SUMMARY = {"run_dir": "r", "parts_ingested": 3, "dedupe": {"skipped": False, "num_near_duplicates": 2, "b": 1, "a": 0},
           "tokenizer": {"vocab_size": 512, "skipped": False}, "eval_tasks": {"tasks": {}}, "num_shards": 4}


def sealed_run(tmp_path: Path) -> ResolvedRun:
    recipe = write_small_recipe(tmp_path, packages=("json",))
    run = resolve_run(recipe)
    (run.paths.root / "shards").mkdir(parents=True)
    (run.paths.root / "shards" / "index.parquet").write_bytes(b"index")
    write_seal(run, "prepare", SUMMARY)
    return run


def test_the_seal_gives_the_skipped_summary_in_the_flows_key_order(tmp_path: Path) -> None:
    run = sealed_run(tmp_path)
    summary = sealed_summary(run, "prepare")
    assert summary == {**SUMMARY, "parts_ingested": 0, "dedupe": {"num_near_duplicates": 2, "b": 1, "a": 0,
                                                                  "skipped": True},
                       "tokenizer": {"vocab_size": 512, "skipped": True}}
    assert list(summary) == list(SUMMARY), "the flow's order"
    assert list(summary["dedupe"]) == ["a", "b", "num_near_duplicates", "skipped"], "as the stage's marker holds it"
    assert sealed_summary(run, "run") is None, "each command has its own seal"
    assert as_skipped(summary) == summary


def test_a_changed_or_new_source_file_breaks_the_seal_and_putting_it_back_restores_it(tmp_path: Path) -> None:
    run = sealed_run(tmp_path)
    source = next((tmp_path / "corpus").rglob("*.py"))
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert sealed_summary(run, "prepare") is None
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sealed_summary(run, "prepare") is not None
    new = source.with_name("zz_new.py")
    new.write_text("x = 1\n")
    assert sealed_summary(run, "prepare") is None
    new.unlink()
    assert sealed_summary(run, "prepare") is not None


def test_any_rewritten_run_dir_file_breaks_the_seal_but_the_stage_time_log_and_lock_do_not(tmp_path: Path) -> None:
    run = sealed_run(tmp_path)
    run.paths.append_text(run.paths.stage_times, '{"stage": "ingest"}\n')  # every skipped stage appends here
    run.paths.lock_file.write_text("12345\n")
    assert sealed_summary(run, "prepare") is not None
    index = run.paths.shard_index
    index.with_name("copy").write_bytes(index.read_bytes())
    os.replace(index.with_name("copy"), index)  # the same bytes, a new file: a writer was here
    assert sealed_summary(run, "prepare") is None


def test_a_changed_recipe_manifest_or_named_file_breaks_the_seal(tmp_path: Path) -> None:
    run = sealed_run(tmp_path)
    recipe_path = tmp_path / "recipe.yaml"
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["train"]["lr"] = 0.02
    recipe_path.write_text(yaml.safe_dump(recipe))
    assert sealed_summary(resolve_run(recipe_path), "prepare") is None
    recipe["train"]["lr"] = 0.01
    recipe_path.write_text(yaml.safe_dump(recipe))
    assert sealed_summary(resolve_run(recipe_path), "prepare") is not None

    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(manifest.read_text() + "# a comment\n")
    assert sealed_summary(run, "prepare") is None
    write_seal(run, "prepare", SUMMARY)

    given = tmp_path / "given-tokenizer.json"  # a file the recipe names: whichever key names it
    given.write_text("{}")
    recipe["tokenizer"] = {"path": given.name}
    recipe_path.write_text(yaml.safe_dump(recipe))
    named = resolve_run(recipe_path)
    write_seal(named, "prepare", SUMMARY)
    assert sealed_summary(named, "prepare") is not None
    given.write_text('{"model": 1}')
    assert sealed_summary(named, "prepare") is None


def test_a_damaged_seal_is_no_seal(tmp_path: Path) -> None:
    run = sealed_run(tmp_path)
    seal = run.paths.command_seal("prepare")
    for damage in (b"", b"[1, 2]", b'{"version": 1, "summary": "not json", "fingerprint": "x"}', b"\xff\xfe"):
        seal.write_bytes(damage)
        assert sealed_summary(run, "prepare") is None


def test_the_seal_names_the_run_dir_only_relatively(tmp_path: Path) -> None:
    """The printed summary names the run dir (its report, its model); the seal in the run dir does not, and
    gives the summary back with the path of the run dir it is read from."""
    run = sealed_run(tmp_path)
    root = str(run.paths.root)
    summary = {**SUMMARY, "run_dir": root, "report": f"{root}/report/index.html", "other": f"{root}2/x"}
    write_seal(run, "prepare", summary)
    assert root.encode() not in run.paths.command_seal("prepare").read_bytes().replace(f"{root}2/x".encode(), b"")
    assert sealed_summary(run, "prepare") == {**as_skipped(summary)}
