"""The tokenmill console script as a user runs it: help, output formats, one-line errors."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.run_sql import view_names
from tests.conftest import build_query_run

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
COMMANDS = [[], ["run"], ["prepare"], ["train"], ["eval"], ["query"], ["report"], ["generate"], ["serve"], ["shards"],
            ["shards", "verify"], ["shards", "stats"], ["shards", "sample"], ["classifier"], ["classifier", "train"]]


def tokenmill(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TOKENMILL, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "top")
def test_every_command_has_help(command: list[str]) -> None:
    result = tokenmill(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout
    assert "Example:" in result.stdout


TYPE_TAG = re.compile(r"<(?:str|bool|int|float|path|int range|float range|[a-z]+(?:\|[a-z]+)+)>")


@pytest.mark.parametrize("command", [[], ["shards", "sample"], ["query"]], ids=lambda c: " ".join(c) or "top")
def test_help_shows_no_type_tags(command: list[str]) -> None:
    result = subprocess.run([TOKENMILL, *command, "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr
    assert "--help" in result.stdout and TYPE_TAG.findall(result.stdout) == []
    if command == ["shards", "sample"]:
        assert "[x>=1]" in result.stdout  # a range says something the help text does not: it stays
    if command == ["query"]:  # every view a statement may name, from the registry (it once missed attributes)
        listed = " ".join(result.stdout.split())
        assert all(re.search(rf"\b{name}\b", listed) for name in view_names()), listed
        assert "attributes" in view_names() and "consumed" in view_names()


@pytest.mark.parametrize("group", [[], ["shards"], ["classifier"]], ids=["top", "shards", "classifier"])
def test_a_group_without_a_command_prints_its_help(group: list[str]) -> None:
    result = tokenmill(*group)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and "Example:" in result.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["report"], "Missing argument 'run_dir'. (see: tokenmill report --help)"),
    (["--bogus"], "No such option: --bogus (see: tokenmill --help)"),
    (["nosuchcmd"], "No such command 'nosuchcmd'. (see: tokenmill --help)"),
    (["shards", "sample", "x", "--n", "0"], "(see: tokenmill shards sample --help)"),
    (["query", "x", "SELECT 1", "--format", "xml"], "'xml' is not one of"),
    (["eval", "no/such/run"], "no/such/run: no run.yaml; give a run dir that tokenmill wrote"),
    (["eval", ".", "--checkpoint", "newest"], "--checkpoint 'newest': give a step number, last or all."),
    (["eval", ".", "--task", "../../etc/x"], "--task '../../etc/x': a task name has letters, digits"),
    (["generate", "no/such/run", "hi", "--temperature", "nan"], "--temperature nan: give a finite number >= 0"),
    (["generate", "no/such/run", "hi", "--temperature", "-1"], "--temperature -1.0: give a finite number >= 0"),
    (["generate", "no/such/run", "hi", "--temperature", "inf"], "--temperature inf: give a finite number >= 0"),
    (["generate", "no/such/run", "hi", "--seed", "-1"], "Invalid value for '--seed'"),
    (["generate", "no/such/run", "hi", "--seed", str(2**64)], "Invalid value for '--seed'"),
    (["shards", "sample", "no/such/run", "--seed", "-1"], "Invalid value for '--seed'"),
    (["shards", "sample", "no/such/run", "--seed", str(2**63)], "Invalid value for '--seed'"),
    (["classifier", "train", "no/such/dir", "x.jsonl", "--out", "m.bin"], "no/such/dir: no such file or folder"),
    (["classifier", "train", "a", "b"], "Missing option '--out'. (see: tokenmill classifier train --help)"),
    # A command-line argument that is not UTF-8 reaches Python as surrogate escapes (here byte 0xff).
    (["generate", "no/such/run", "ab\udcffcd"], "PROMPT is not valid UTF-8 text (byte 0xff at position 2)"),
])
def test_usage_errors_are_one_line_with_exit_2(args: list[str], expected: str) -> None:
    result = tokenmill(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_query_formats(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    sql = "SELECT doc_id, source FROM documents ORDER BY doc_id"
    as_csv = tokenmill("query", str(run), sql, "--format", "csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [["doc_id", "source"], ["1", "a"], ["3", "b"]]
    as_json = tokenmill("query", str(run), sql, "--format", "json")
    assert json.loads(as_json.stdout) == [{"doc_id": 1, "source": "a"}, {"doc_id": 3, "source": "b"}]
    as_table = tokenmill("query", str(run), sql)
    assert "doc_id" in as_table.stdout and "source" in as_table.stdout


def test_write_attempt_is_one_line_error(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    result = tokenmill("query", str(run), "COPY documents TO 'x.csv'")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "read-only" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback_of_a_user_error(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    result = tokenmill("--debug", "query", str(run), "COPY documents TO 'x.csv'")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "QueryError" in result.stderr and "read-only" in result.stderr


def test_shards_verify_passes_then_catches_a_flipped_byte(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    assert tokenmill("shards", "verify", str(run)).returncode == 0
    shard = next(run.glob("shards/**/*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = tokenmill("shards", "verify", str(run))
    assert result.returncode == 1 and "sha256" in result.stdout


@pytest.mark.parametrize(("recipe_text", "expected"), [
    ("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\ntrain: {max_stepz: 3}\n",
     "train.max_stepz: unknown key"),
    ("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\ntrain: {max_stpes: 3}\n",
     "train.max_stpes: unknown key (misspelt?); did you mean `max_steps`?"),
    ("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\ntrain: {lr: -1}\n", "train.lr"),
    ("name: x\ndata: {manifests: [missing.yaml]}\ntokenizer: {vocab_size: 512}\n", "missing.yaml does not exist"),
    ("name: x\ndata: {manifests: [m.yaml]\n", "invalid YAML"),
    ("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512, path: t.json}\n", "exactly one of"),
])
def test_recipe_errors_name_the_key_in_one_line(tmp_path: Path, recipe_text: str, expected: str) -> None:
    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "recipe.yaml").write_text(recipe_text)
    result = tokenmill("prepare", str(tmp_path / "recipe.yaml"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in result.stderr
    assert str(tmp_path / "recipe.yaml") in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_manifest_path_error_names_the_source(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: nowhere, format: text}]\n")
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\n")
    result = tokenmill("prepare", str(tmp_path / "recipe.yaml"))
    assert result.returncode == 2
    assert "sources[s].path 'nowhere' does not exist" in result.stderr


def test_second_run_on_a_busy_run_dir_is_one_line_naming_the_holder(tmp_path: Path) -> None:
    from core.rundir import RunPaths

    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\n")
    with RunPaths(tmp_path / "run").lock():
        result = tokenmill("prepare", str(tmp_path / "recipe.yaml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by pid" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.slow
def test_unreadable_file_mid_flow_names_the_file_without_traceback(tmp_path: Path) -> None:
    import gzip

    (tmp_path / "corpus").mkdir()
    whole = gzip.compress(b'{"text": "a perfectly fine first record"}\n' * 50)
    (tmp_path / "corpus" / "good.jsonl.gz").write_bytes(whole)
    (tmp_path / "corpus" / "truncated.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: jsonl}]\n")
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 300}\n")
    result = tokenmill("prepare", str(tmp_path / "recipe.yaml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "truncated.jsonl.gz" in errors[0] and "on_error: skip" in errors[0]
    assert result.stderr.count("Retry") == 0, "bad input is not retried"
    said = result.stdout + result.stderr  # said once, last: not also in Prefect's task and flow ERROR lines
    assert said.count("truncated.jsonl.gz") == 1 and said.rstrip().endswith(errors[0]), said
    quiet = tokenmill("-q", "prepare", str(tmp_path / "recipe.yaml"), "--run-dir", str(tmp_path / "run"))
    assert quiet.returncode == 2 and quiet.stderr.splitlines() == errors, quiet.stderr  # no INFO lines either


def test_train_before_prepare_is_one_line_before_any_server_and_leaves_no_run_dir(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\n")
    result = tokenmill("train", str(tmp_path / "recipe.yaml"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"error: {tmp_path / 'run/shards/index.parquet'}: no shard index; "
                                          "run `tokenmill prepare` first."]
    assert "flow run" not in result.stdout + result.stderr  # refused before Prefect started
    assert not (tmp_path / "run").exists()


def test_a_changed_recipe_is_refused_before_any_server(tmp_path: Path) -> None:
    from flows.recipe import load_recipe, record_recipe

    (tmp_path / "m.yaml").write_text("name: m\nsources: [{name: s, path: corpus, format: text}]\n")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 512}\n")
    record_recipe(*load_recipe(tmp_path / "recipe.yaml"), tmp_path / "run")  # as a prepare records it
    (tmp_path / "recipe.yaml").write_text("name: x\ndata: {manifests: [m.yaml]}\ntokenizer: {vocab_size: 600}\n")
    for command in ("prepare", "train", "run"):
        result = tokenmill(command, str(tmp_path / "recipe.yaml"), "--run-dir", str(tmp_path / "run"))
        assert result.returncode == 2, result.stdout + result.stderr
        assert len(result.stderr.splitlines()) == 1 and "recipe changed since" in result.stderr, result.stderr
        assert "tokenizer.vocab_size" in result.stderr and "flow run" not in result.stdout + result.stderr


def test_ctrl_c_during_a_long_query_exits_130_at_once(tmp_path: Path) -> None:
    import os
    import signal
    import time

    run = build_query_run(tmp_path / "run")
    endless = "SELECT sum(a.range * b.range) FROM range(1000000) a, range(1000000) b"
    process = subprocess.Popen([TOKENMILL, "query", str(run), endless], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(3)  # started, and deep in the join (it would run for hours)
    assert process.poll() is None, process.communicate()
    os.killpg(process.pid, signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("tokenmill query still running 60 s after Ctrl-C")
    assert process.returncode == 130 and stderr.splitlines() == ["interrupted"], stderr


def test_shards_stats_and_sample_on_a_real_run(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    stats = json.loads(tokenmill("shards", "stats", str(run), "--format", "json").stdout)
    assert [(row["split"], row["source"], row["num_rows"], row["num_tokens"]) for row in stats] == \
        [("train", "a", 2, 16)]
    sample = json.loads(tokenmill("shards", "sample", str(run), "--n", "1", "--no-decode", "--format", "json").stdout)
    assert len(sample) == 1 and sample[0]["shard_path"].startswith("shards/split=train/")
