"""Querying a run dir in a bucket (a real SeaweedFS S3 server): every view answers as on the local copy, and the
connection stays confined to the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

from core.errors import QueryError
from flows.run_sql import run_query
from pipeline.sql.run_mirror import mirror_root
from tests.conftest import build_query_run

VIEW_QUERIES = {
    "documents": "SELECT * FROM documents ORDER BY doc_id",
    "rejects": "SELECT * FROM rejects ORDER BY uri",
    "attributes": "SELECT * FROM attributes ORDER BY uri",
    "duplicates": "SELECT * FROM duplicates ORDER BY doc_id",
    "shards": "SELECT * FROM shards ORDER BY path",
    "sequences": "SELECT * EXCLUDE (input_ids), list_sum(input_ids) AS token_sum FROM sequences "
                 "ORDER BY shard_path, row_in_shard",
    "train_metrics": "SELECT * FROM train_metrics ORDER BY step",
    "eval_metrics": "SELECT * FROM eval_metrics ORDER BY step",
}


@pytest.fixture
def uploaded_run(tmp_path: Path, s3_prefix: str) -> tuple[Path, str]:
    """A run dir with a row in every view, and its copy at ``s3://<bucket>/runs/q``."""
    run = build_query_run(tmp_path / "q")
    (run / "metrics/eval.jsonl").write_text(json.dumps({"step": 2, "val_loss": 4.5, "val_ppl": 90.0,
                                                        "val_rows": 2, "val_tokens": 16}) + "\n")
    url = f"{s3_prefix}/runs/q"
    s3fs.S3FileSystem().put(f"{run}/", f"{url}/", recursive=True)
    return run, url


def test_every_view_of_a_run_in_a_bucket_equals_the_local_one(uploaded_run: tuple[Path, str]):
    run, url = uploaded_run
    for view, sql in VIEW_QUERIES.items():
        local, remote = run_query(run, sql), run_query(url, sql)
        assert local.num_rows > 0, view
        assert remote.to_pylist() == local.to_pylist(), view
    kept = run_query(url, "SELECT list(uri ORDER BY uri) AS uris FROM documents").to_pylist()
    assert kept == [{"uris": ["f.py", "h.jsonl:1"]}]  # the duplicate g.py is removed through the registered views


def test_the_cli_queries_a_bucket_and_names_a_missing_run(uploaded_run: tuple[Path, str], s3_prefix: str):
    _, url = uploaded_run
    tokenmill = str(Path(sys.executable).parent / "tokenmill")
    argv = [tokenmill, "query", url, "SELECT count(*) AS n FROM sequences", "--format", "json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"n": 2}]
    missing = subprocess.run([*argv[:2], f"{s3_prefix}/runs/nothing", "SELECT 1"], capture_output=True, text=True,
                             timeout=120, check=False)
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and f"{s3_prefix}/runs/nothing" in missing.stderr


def test_a_run_in_a_bucket_is_confined_like_a_local_one(uploaded_run: tuple[Path, str], s3_prefix: str):
    _, url = uploaded_run
    fs = s3fs.S3FileSystem()
    fs.pipe(f"{s3_prefix}/outside/secret.parquet", fs.cat(f"{url}/rejects/part-00000.parquet"))
    for sql in (f"SELECT * FROM read_parquet('{s3_prefix}/outside/secret.parquet')",
                "SELECT * FROM read_csv('/etc/passwd')",
                f"SELECT * FROM read_parquet('{url}/docs/part-00000.parquet')"):
        with pytest.raises(QueryError, match=r"disabled|not allowed|Permission"):
            run_query(url, sql)
    fs.pipe(f"{url}/shards/split=train/stray.arrow", b"not a shard")
    with pytest.raises(QueryError, match=r"stray\.arrow"):
        run_query(url, "SELECT count(*) FROM sequences")
    assert run_query(url, "SELECT count(*) AS n FROM documents").to_pylist() == [{"n": 2}]


def test_views_built_from_files_come_from_the_mirror(uploaded_run: tuple[Path, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    run, url = uploaded_run
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    segment = {"segment": 0, "start_step": 0, "start_sample": 0, "num_processes": 1, "world_size": 1,
               "micro_batch_size": 8, "grad_accum_steps": 1, "seed": 7, "shards": [{"num_rows": 2}]}
    (run / "metrics/train_segments.jsonl").write_text(json.dumps(segment) + "\n")
    s3fs.S3FileSystem().put(str(run / "metrics/train_segments.jsonl"), f"{url}/metrics/train_segments.jsonl")
    sql = "SELECT seed, num_train_rows FROM train_segments"
    assert run_query(url, sql).to_pylist() == run_query(run, sql).to_pylist() == [{"seed": 7, "num_train_rows": 2}]
    assert (mirror_root(url) / "metrics/train_segments.jsonl").is_file()


def test_shards_and_report_commands_on_a_bucket_answer_as_on_the_local_run(
        uploaded_run: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from flows.cli.commands import app

    run, url = uploaded_run
    fs = s3fs.S3FileSystem()
    fs.pipe(f"{url}/checkpoints/step-0000002/model.safetensors", b"w" * 1000)  # weights: never mirrored
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    runner = CliRunner()
    for command in (["shards", "verify"], ["shards", "stats", "--format", "json"],
                    ["shards", "sample", "--n", "2", "--no-decode", "--format", "json"]):
        local, remote = runner.invoke(app, [*command, str(run)]), runner.invoke(app, [*command, url])
        assert local.exit_code == remote.exit_code == 0, remote.output
        assert remote.stdout.replace(str(mirror_root(url)), str(run)) == local.stdout, command
    mirror = mirror_root(url)
    assert not (mirror / "checkpoints/step-0000002/model.safetensors").exists()

    remote = runner.invoke(app, ["report", url])
    assert remote.exit_code == 0, remote.output
    assert remote.stdout.strip() == f"wrote {mirror / 'report/index.html'}"
    local = runner.invoke(app, ["report", str(run)])
    assert local.exit_code == 0, local.output
    assert (mirror / "report/report.md").read_text() == (run / "report/report.md").read_text()

    fs.rm(f"{url}/dedupe/duplicates.parquet")  # the mirror follows the bucket: a key gone is gone locally
    assert runner.invoke(app, ["shards", "verify", url]).exit_code == 0
    assert not (mirror / "dedupe/duplicates.parquet").exists()


def test_a_shard_in_a_bucket_whose_bytes_differ_from_the_index_is_refused(uploaded_run: tuple[Path, str]):
    """Issue #34: the shard is checked against the bucket's index as it is read (a flipped token byte)."""
    run, url = uploaded_run
    shard = "shards/split=train/source=a/part-00000.arrow"
    data = bytearray((run / shard).read_bytes())
    tokens = b"".join(number.to_bytes(2, "little") for number in range(16))  # the shard's ids, uint16
    data[data.index(tokens) + 2 * 5 + 1] ^= 0xFF  # token 5's high byte
    s3fs.S3FileSystem().pipe(f"{url}/{shard}", bytes(data))
    assert run_query(url, "SELECT count(*) AS n FROM documents").to_pylist() == [{"n": 2}]
    with pytest.raises(QueryError) as refused:
        run_query(url, "SELECT max(list_max(input_ids)) FROM sequences")
    message = str(refused.value)
    assert message.startswith(f"{url}/{shard}: its sha256 differs from shards/index.parquet") and "\n" not in message
