"""A command's seal (flows.up_to_date) holds exactly while every stage of the command is done, as it was sealed.

In-process and without Prefect: a small run dir is prepared once (every prepare stage through run_stage, as the
flow runs them), each test seals a copy of it, then changes an input and puts it back. The commands themselves
(a seal written by a run that did the work, the skipped summary equal to a skipped flow's) are run in
tests/test_readme_commands.py on the quick start's run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from core.stage import run_stage
from flows.recipe import ResolvedRun, record_run, resolve_run
from flows.stage_list import PREPARE_STAGES, build_stages
from flows.up_to_date import as_skipped, command_status, sealed_summary, write_seal
from pipeline.ingest.stage import IngestStage
from tests.flows.conftest import write_small_recipe

SUMMARY = {"run_dir": "r", "parts_ingested": 3, "dedupe": {"skipped": False, "num_near_duplicates": 2, "b": 1, "a": 0},
           "tokenizer": {"vocab_size": 512, "skipped": False}, "eval_tasks": {"tasks": {}}, "num_shards": 4}


def portable_recipe(root: Path, packages: tuple[str, ...] = ("json",)) -> Path:
    """:func:`write_small_recipe` with the manifest naming its corpus relatively: a copy of ``root`` is the same
    recipe over the same files (open it with :func:`open_run`, which puts the run dir in ``root/run``)."""
    recipe = write_small_recipe(root, packages=packages)
    manifest = yaml.safe_load((root / "manifest.yaml").read_text())
    manifest["sources"][0]["path"] = "corpus"
    (root / "manifest.yaml").write_text(yaml.safe_dump(manifest))
    return recipe


def open_run(root: Path) -> ResolvedRun:
    """The run of ``root/recipe.yaml`` in ``root/run``, resolved as a command resolves it (manifests read now)."""
    return resolve_run(root / "recipe.yaml", root / "run")


def prepare_in_process(run: ResolvedRun, *, record: bool = True) -> None:
    """What ``tokenmill prepare`` does without Prefect: run.yaml, then each unit of each prepare stage in order."""
    with run.paths.lock():
        if record:
            record_run(run)
        stages = build_stages(PREPARE_STAGES, run)
        assert isinstance(stages[0], IngestStage)
        stages[0].plan()
        for stage in stages:
            for unit in stage.units():
                run_stage(stage, unit)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recipe over the json package and its prepared run dir (every prepare stage done): copy it, don't edit it."""
    root = tmp_path_factory.mktemp("prepared")
    portable_recipe(root)
    prepare_in_process(open_run(root))
    return root


def sealed_run(prepared: Path, tmp_path: Path) -> ResolvedRun:
    """A copy of the prepared root, its prepare command sealed with SUMMARY."""
    root = tmp_path / "root"
    shutil.copytree(prepared, root, symlinks=True)
    run = open_run(root)
    assert write_seal(run, "prepare", SUMMARY), command_status(run, "prepare").redo
    return run


def test_the_seal_gives_the_skipped_summary_in_the_flows_key_order(prepared: Path, tmp_path: Path) -> None:
    run = sealed_run(prepared, tmp_path)
    summary = sealed_summary(run, "prepare")
    assert summary == {**SUMMARY, "parts_ingested": 0, "dedupe": {"num_near_duplicates": 2, "b": 1, "a": 0,
                                                                  "skipped": True},
                       "tokenizer": {"vocab_size": 512, "skipped": True}}
    assert list(summary) == list(SUMMARY), "the flow's order"
    assert list(summary["dedupe"]) == ["a", "b", "num_near_duplicates", "skipped"], "as the stage's marker holds it"
    assert sealed_summary(run, "run") is None, "each command has its own seal"
    assert as_skipped(summary) == summary


def test_a_command_with_a_stage_to_do_is_not_sealed(prepared: Path, tmp_path: Path) -> None:
    """Nothing of ``run`` past the data was done; an output went missing; a unit has no marker (what a failed unit
    leaves, a failed evaluation result included): no seal is written, and a seal written before holds no more."""
    run = sealed_run(prepared, tmp_path)
    assert not write_seal(run, "run", SUMMARY) and not run.paths.command_seal("run").exists()
    page = run.paths.report_page.read_bytes()
    run.paths.report_page.unlink()  # an output missing: the report is rendered again (its inputs are the same)
    assert sealed_summary(run, "prepare") is None
    run.paths.report_page.write_bytes(page)
    assert sealed_summary(run, "prepare") is not None
    run.paths.marker("dedupe").write_text('{"summary": {}}')  # a marker of before stages: the flow refuses it
    assert sealed_summary(run, "prepare") is None
    run.paths.marker("dedupe").unlink()
    assert sealed_summary(run, "prepare") is None
    assert not write_seal(run, "prepare", SUMMARY)


def test_a_new_source_file_breaks_the_seal_and_removing_it_restores_it(prepared: Path, tmp_path: Path) -> None:
    """A new file is a new ingest part to do. A changed file that was ingested already is not re-read (the ingest
    stage stays done; `tokenmill status` notes it): the seal holds, as the stages do."""
    run = sealed_run(prepared, tmp_path)
    source = next((run.base / "corpus").rglob("*.py"))
    new = source.with_name("zz_new.py")
    new.write_text("x = 1\n")
    assert sealed_summary(run, "prepare") is None
    new.unlink()
    assert sealed_summary(run, "prepare") is not None
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert sealed_summary(run, "prepare") is not None  # `tokenmill status` notes the file (not a redo)


def test_a_run_dir_file_a_stage_reads_breaks_the_seal_but_the_stage_time_log_and_lock_do_not(
        prepared: Path, tmp_path: Path) -> None:
    """The report reads every file of the run dir but the stage-time log and the lock (which every skipped stage
    and command writes); a small file rewritten with the same bytes is unchanged to every stage."""
    run = sealed_run(prepared, tmp_path)
    run.paths.append_text(run.paths.stage_times, '{"stage": "ingest"}\n')
    run.paths.lock_file.write_text("12345\n")
    index = run.paths.shard_index
    index.with_name("copy").write_bytes(index.read_bytes())
    os.replace(index.with_name("copy"), index)
    assert sealed_summary(run, "prepare") is not None
    note = run.paths.root / "notes.txt"
    note.write_text("a file of the user's\n")
    assert sealed_summary(run, "prepare") is None
    note.unlink()
    assert sealed_summary(run, "prepare") is not None
    next(run.paths.root.glob("shards/split=train/*/*.arrow")).unlink()
    assert sealed_summary(run, "prepare") is None


def test_a_changed_recipe_setting_manifest_or_named_file_breaks_the_seal(prepared: Path, tmp_path: Path) -> None:
    run = sealed_run(prepared, tmp_path)
    root = run.base
    recipe_path = root / "recipe.yaml"
    recipe = yaml.safe_load(recipe_path.read_text())
    recipe["tokenizer"]["vocab_size"] = 600
    recipe_path.write_text(yaml.safe_dump(recipe))
    assert sealed_summary(open_run(root), "prepare") is None
    recipe["tokenizer"]["vocab_size"] = 512
    recipe["train"]["lr"] = 0.02  # no prepare stage reads it
    recipe_path.write_text(yaml.safe_dump(recipe))
    assert sealed_summary(open_run(root), "prepare") is not None

    manifest_path = root / "manifest.yaml"
    manifest = manifest_path.read_text()
    manifest_path.write_text(manifest + "filters: {min_chars: 5000}\n")
    assert sealed_summary(open_run(root), "prepare") is None
    manifest_path.write_text(manifest)
    assert sealed_summary(open_run(root), "prepare") is not None

    given = root / "given-tokenizer.json"  # a file the recipe names
    shutil.copyfile(run.paths.tokenizer, given)
    recipe["tokenizer"] = {"path": given.name}
    recipe_path.write_text(yaml.safe_dump(recipe))
    named = open_run(root)
    assert sealed_summary(named, "prepare") is None, "the tokenizer stage now reads the given file"
    prepare_in_process(named, record=False)
    assert sealed_summary(named, "prepare") is None, "done again, but not as sealed: the seal's summary is older"
    assert write_seal(named, "prepare", SUMMARY) and sealed_summary(named, "prepare") is not None
    given.write_text(given.read_text() + "\n")
    assert sealed_summary(open_run(root), "prepare") is None


def test_a_damaged_seal_is_no_seal(prepared: Path, tmp_path: Path) -> None:
    run = sealed_run(prepared, tmp_path)
    seal = run.paths.command_seal("prepare")
    intact = json.loads(seal.read_text())
    for damage in (b"", b"[1, 2]", json.dumps({**intact, "units": "x"}).encode(),
                   json.dumps({**intact, "summary": "not json"}).encode(),
                   json.dumps({**intact, "version": 1}).encode(), b"\xff\xfe"):
        seal.write_bytes(damage)
        assert sealed_summary(run, "prepare") is None
    seal.write_text(json.dumps(intact))
    assert sealed_summary(run, "prepare") is not None


def test_the_seal_names_the_run_dir_only_relatively(prepared: Path, tmp_path: Path) -> None:
    """The printed summary names the run dir (its report, its model); the seal in the run dir does not, and
    gives the summary back with the path of the run dir it is read from."""
    run = sealed_run(prepared, tmp_path)
    root = str(run.paths.root)
    summary = {**SUMMARY, "run_dir": root, "report": f"{root}/report/index.html", "other": f"{root}2/x"}
    write_seal(run, "prepare", summary)
    assert root.encode() not in run.paths.command_seal("prepare").read_bytes().replace(f"{root}2/x".encode(), b"")
    assert sealed_summary(run, "prepare") == {**as_skipped(summary)}
