"""A file planned into an ingest part and deleted before the part is read: one ``missing_file`` reject, and the
run goes on (issue 16, item 5).

A planned file stays in its part (``docs/plan.json``), so failing on it would fail every re-run: the run would be
stuck, and a user who removed a broken file because an error told them to would meet the next error. The file
holds no records any more, so nothing valid is lost; its name stays in the funnel as the reject.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from core.rundir import RunPaths
from flows.run_sql import run_query
from pipeline.ingest.stage import ingest_part, plan_ingest
from tests.chaos.conftest import build_chaos_corpus, tokenmill, write_chaos_recipe
from tests.chaos.test_bad_inputs import assert_one_line_error
from tests.chaos.test_hostile_inputs import (
    jsonl,
    plant_text_files,
    rejects_by_uri,
    source,
    texts_of,
    valid_texts,
    write_manifest,
)


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize("fmt", ["text", "jsonl"])
def test_a_planned_file_deleted_before_its_part_is_read_is_one_missing_file_reject(tmp_path: Path, on_error: str,
                                                                                  fmt: str) -> None:
    corpus = tmp_path / "corpus"
    texts = valid_texts(3)
    if fmt == "text":
        plant_text_files(corpus, texts)
        names = [f"good-{number}.txt" for number in range(3)]
    else:
        corpus.mkdir()
        names = [f"records-{number}.jsonl" for number in range(3)]
        for name, text in zip(names, texts, strict=True):
            (corpus / name).write_bytes(jsonl([text]))
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([write_manifest(tmp_path, [source(fmt=fmt, on_error=on_error)])], paths, 1 << 20)
    (corpus / names[1]).unlink()
    for part in parts:
        ingest_part(part, 0.0, paths)
    assert texts_of(paths) == sorted([texts[0], texts[2]])
    rejects = rejects_by_uri(paths)
    assert list(rejects) == [names[1]]
    assert rejects[names[1]]["reason"] == "missing_file" and rejects[names[1]]["raw"] is None
    assert "no longer in the source folder" in rejects[names[1]]["detail"]
    assert plan_ingest([write_manifest(tmp_path, [source(fmt=fmt, on_error=on_error)])], paths, 1 << 20) == []


def test_a_planned_file_whose_link_target_is_gone_is_a_missing_file_reject(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    texts = valid_texts(2)
    plant_text_files(corpus, texts)
    (corpus / "target.txt").write_text(valid_texts(1, start=10)[0])
    (corpus / "linked.txt").symlink_to(corpus / "target.txt")
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([write_manifest(tmp_path, [source()])], paths, 1 << 20)
    (corpus / "target.txt").unlink()
    for part in parts:
        ingest_part(part, 0.0, paths)
    assert texts_of(paths) == sorted(texts)
    assert {uri: row["reason"] for uri, row in rejects_by_uri(paths).items()} == {
        "linked.txt": "missing_file", "target.txt": "missing_file"}


@pytest.mark.slow
def test_removing_the_file_an_error_named_lets_the_next_prepare_finish(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """The loop a user met: a broken file fails the run ("fix or remove the file"), they remove it, and the
    re-run failed again on the missing file, for ever. Now the re-run finishes and the funnel names the file."""
    corpus = build_chaos_corpus(tmp_path)
    noise = corpus / "records" / "noise.jsonl.zst"
    noise.write_bytes(random.Random(3).randbytes(5000))
    recipe = write_chaos_recipe(tmp_path, corpus)
    first = tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=cli_env)
    assert_one_line_error(first, "noise.jsonl.zst", "fix or remove the file")
    noise.unlink()
    again = tokenmill("prepare", recipe, "--run-dir", tmp_path / "run", env=cli_env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stdout + again.stderr
    found = run_query(tmp_path / "run", "SELECT uri, reason FROM rejects WHERE reason = 'missing_file'").to_pylist()
    assert found == [{"uri": "noise.jsonl.zst", "reason": "missing_file"}]
    assert (tmp_path / "run" / "shards" / "index.parquet").is_file()
