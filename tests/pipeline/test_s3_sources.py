"""Sources in a bucket (a real SeaweedFS S3 server): listed, read and refreshed like the same files on disk."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
import yaml
import zstandard

from core.errors import ManifestError, ObjectStoreError
from core.rundir import RunPaths
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.manifest import load_manifest
from tests.conftest import STDLIB

DOC_FILES = sorted(path for path in Path("/usr/share/doc").glob("*/copyright") if path.is_file())[:40]
"""Debian's plain-text licence files: real prose, on every Debian-based machine."""


def write_corpus(folder: Path) -> Path:
    """A few hundred KB of real text in every streamed format: .py text, JSONL .gz and .zst, Parquet."""
    (folder / "code").mkdir(parents=True)
    for source in sorted((STDLIB / "json").glob("*.py")):
        shutil.copyfile(source, folder / "code" / source.name)
    lines = [json.dumps({"id": str(path), "text": path.read_text(errors="replace")}) for path in DOC_FILES]
    (folder / "records").mkdir()
    half = len(lines) // 2
    (folder / "records/a.jsonl.gz").write_bytes(gzip.compress("\n".join(lines[:half]).encode() + b"\n{oops\n"))
    (folder / "records/b.jsonl.zst").write_bytes(zstandard.compress("\n".join(lines[half:]).encode()))
    texts = [path.read_text() for path in sorted((STDLIB / "email").glob("*.py"))]
    pq.write_table(pa.table({"text": texts, "id": [str(i) for i in range(len(texts))]}), folder / "records/c.parquet")
    (folder / "records/skip.tmp").write_text("excluded by the manifest")
    return folder


def write_manifest(path: Path, root: str) -> Path:
    sources = [{"name": "code", "path": f"{root}/code", "format": "text", "glob": "*.py"},
               {"name": "records", "path": f"{root}/records", "format": "jsonl", "glob": "*.jsonl*",
                "id_field": "id"},
               {"name": "tables", "path": f"{root}/records/c.parquet", "format": "parquet", "id_field": "id"}]
    path.write_text(yaml.safe_dump({"name": "mixed", "sources": sources}))
    return path


def ingest(manifest: Path, run: Path) -> pa.Table:
    paths = RunPaths(run)
    for part in plan_ingest([manifest], paths, 64 << 10):
        ingest_part(part, 0.1, paths)
    tables = [pq.read_table(part) for part in sorted(paths.docs.glob("part-*.parquet"))]
    return pa.concat_tables(tables)


def rejects(run: Path) -> list[tuple[str, str]]:
    table = pa.concat_tables([pq.read_table(part) for part in sorted((run / "rejects").glob("part-*.parquet"))])
    return sorted(zip(table["uri"].to_pylist(), table["reason"].to_pylist(), strict=True))


def test_ingest_from_a_bucket_equals_the_local_run_and_refresh_sees_new_objects(tmp_path: Path, s3_prefix: str):
    corpus = write_corpus(tmp_path / "corpus")
    fs = s3fs.S3FileSystem()
    fs.put(f"{corpus}/", f"{s3_prefix}/corpus/", recursive=True)
    assert sorted(fs.find(f"{s3_prefix}/corpus")) == sorted(
        f"{s3_prefix.removeprefix('s3://')}/corpus/{p.relative_to(corpus).as_posix()}"
        for p in corpus.rglob("*") if p.is_file())

    local = ingest(write_manifest(tmp_path / "local.yaml", str(corpus)), tmp_path / "run-local")
    manifest = write_manifest(tmp_path / "remote.yaml", f"{s3_prefix}/corpus")
    remote = ingest(manifest, tmp_path / "run-remote")

    assert remote.num_rows == local.num_rows > 50
    assert remote.equals(local)  # same uris, doc_ids, hashes and order: a bucket is read as the folder is
    assert rejects(tmp_path / "run-remote") == rejects(tmp_path / "run-local") == [
        (f"a.jsonl.gz:{len(DOC_FILES) // 2 + 1}", "invalid_json")]
    plan = json.loads((tmp_path / "run-remote/docs/plan.json").read_text())
    assert all(version.startswith("ETag:") for _, version in plan["files"]["records"].values())

    # The nightly refresh: one new object is ingested; a changed one (new ETag and size) is seen and named.
    fs.pipe(f"{s3_prefix}/corpus/code/new_module.py", b"def added_tonight():\n    return 'a new object'\n")
    fs.pipe(f"{s3_prefix}/corpus/code/tool.py", (corpus / "code/tool.py").read_bytes() + b"\n# changed\n")
    paths = RunPaths(tmp_path / "run-remote")
    with pytest.warns(UserWarning, match="tool.py changed after it was ingested"):
        new_parts = plan_ingest([manifest], paths, 64 << 10)
    assert [part.files for part in new_parts] == [("new_module.py",)]
    [summary] = [ingest_part(part, 0.1, paths) for part in new_parts]
    assert summary["num_documents"] == 1


def test_a_missing_bucket_is_one_line_naming_the_url(tmp_path: Path, s3_endpoint: str):
    manifest = write_manifest(tmp_path / "m.yaml", "s3://no-such-bucket-tokenmill/corpus")
    with pytest.raises((ManifestError, ObjectStoreError)) as err:
        plan_ingest([manifest], RunPaths(tmp_path / "run"), 1 << 20)
    message = str(err.value)
    assert "s3://no-such-bucket-tokenmill/corpus/code" in message and "\n" not in message
    assert "AWS_ENDPOINT_URL" in message


@pytest.mark.parametrize(("options", "named"), [({"key": "AKIA"}, "storage_options.key"),
                                                ({"client_kwargs": {"aws_secret_access_key": "x"}},
                                                 "client_kwargs.aws_secret_access_key"),
                                                ({"session_token": "x"}, "storage_options.session_token"),
                                                ({"endpoint_url": "http://AKIA:xyz@127.0.0.1:1"},
                                                 "storage_options.endpoint_url holds credentials")])
def test_a_secret_in_a_manifest_is_refused(tmp_path: Path, options: dict, named: str):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"name": "m", "sources": [{"name": "s", "path": "s3://bkt/p/", "format": "text",
                                                              "storage_options": options}]}))
    with pytest.raises(ManifestError, match=named.replace(".", r"\.")) as err:
        load_manifest(path)
    assert "AWS_ACCESS_KEY_ID" in str(err.value)


def test_credentials_in_a_url_are_refused_and_endpoint_options_allowed(tmp_path: Path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"name": "m", "sources": [{"name": "s", "path": "s3://AKIA:xyz@b/p/",
                                                              "format": "text"}]}))
    with pytest.raises(ManifestError, match="holds credentials") as err:
        load_manifest(path)
    assert "xyz" not in str(err.value)
    path.write_text(yaml.safe_dump({"name": "m", "sources": [{"name": "s", "path": "s3://bkt/p/", "format": "text",
                                    "storage_options": {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},
                                                        "region_name": "eu-west-1"}}]}))
    assert load_manifest(path).sources[0].storage_options["region_name"] == "eu-west-1"


def test_connection_refused_is_retried_each_retry_logged_once_then_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    from tests.flows.prefect_server import free_port

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    for name, value in {"AWS_ENDPOINT_URL": closed, "AWS_MAX_ATTEMPTS": "3", "AWS_RETRY_MODE": "legacy",
                        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.WARNING, logger="pipeline.objects")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(ObjectStoreError) as err:
            plan_ingest([write_manifest(tmp_path / "m.yaml", "s3://any-bucket/corpus")], RunPaths(tmp_path / "r"), 1)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()  # the session's server is used again by the next test
    message = str(err.value)
    assert message.startswith("s3://any-bucket/corpus/code: cannot reach the object store") and "\n" not in message
    assert "AWS_ENDPOINT_URL" in message
    retries = [record.getMessage() for record in caplog.records if record.name == "pipeline.objects"]
    assert len(retries) == 2, retries  # 3 attempts: 2 retries, each logged once
    assert all("transient error" in line and closed in line for line in retries)
    assert err.value.retryable  # the store may be back by the flow's retry


def test_wrong_credentials_are_one_line_naming_the_url_and_what_to_set(
        tmp_path: Path, s3_prefix: str, monkeypatch: pytest.MonkeyPatch):
    s3fs.S3FileSystem().pipe(f"{s3_prefix}/corpus/code/a.py", b"print('hello')\n")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(ObjectStoreError) as err:
            plan_ingest([write_manifest(tmp_path / "m.yaml", f"{s3_prefix}/corpus")], RunPaths(tmp_path / "r"), 1)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    message = str(err.value)
    assert message.startswith(f"{s3_prefix}/corpus/code: access denied") and "\n" not in message
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message and "not-the-secret" not in message
    assert not getattr(err.value, "retryable", False)  # bad credentials stay bad: no flow retry


def test_an_object_deleted_after_planning_is_one_missing_file_reject(tmp_path: Path, s3_prefix: str):
    fs = s3fs.S3FileSystem()
    for name in ("a.py", "b.py"):
        fs.pipe(f"{s3_prefix}/corpus/code/{name}", f"def {name[0]}():\n    return '{name}'\n".encode())
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump({"name": "m", "sources": [{"name": "code", "path": f"{s3_prefix}/corpus/code/",
                                                                  "format": "text", "exclude": ["b.*"]}]}))
    paths = RunPaths(tmp_path / "run")
    [part] = plan_ingest([manifest], paths, 1 << 20)
    assert part.files == ("a.py",)  # exclude applies to keys as to local paths
    fs.rm(f"{s3_prefix}/corpus/code/a.py")
    summary = ingest_part(part, 0.1, paths)
    assert (summary["num_documents"], summary["rejects_by_reason"]) == (0, {"missing_file": 1})


def test_a_bucket_source_that_matches_no_object_is_one_error_naming_the_url(tmp_path: Path, s3_prefix: str):
    """Issue #34: a glob typo made a source vanish from the run without a word; objects are listed like files."""
    fs = s3fs.S3FileSystem()
    fs.pipe(f"{s3_prefix}/typo/records/a.jsonl", b'{"text": "one record"}\n')
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump({"name": "m", "sources": [
        {"name": "records", "path": f"{s3_prefix}/typo/records", "format": "jsonl", "glob": "*.jsnol"}]}))
    with pytest.raises(ManifestError) as refused:
        plan_ingest([manifest], RunPaths(tmp_path / "run"), 1 << 20)
    message = str(refused.value)
    assert f"sources[records] matches no file: glob '*.jsnol' under {s3_prefix}/typo/records;" in message
    assert "did you mean glob '*.jsonl'?" in message and "\n" not in message
