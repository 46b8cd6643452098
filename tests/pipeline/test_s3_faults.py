"""Object store faults (a real SeaweedFS server, killed and started again on the same data and ports): an ingest
from a bucket survives the store going away mid-object, and rides out a short outage on retries; a run mirror cut
short mid-object is completed by the next one."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import s3fs
import yaml

from core.errors import ObjectStoreError, StoreUnavailableError
from core.files.atomic import TEMP_PREFIX
from core.rundir import RunPaths
from pipeline.ingest.stage import ingest_part, part_finished, plan_ingest
from pipeline.objects import object_store_error
from pipeline.sql.run_mirror import mirror_root, mirror_run
from tests.conftest import STDLIB, build_query_run
from tests.s3_server import SeaweedServer, clear_instance_cache, s3_environment

BUCKET = "tokenmill-faults"
BIG_OBJECT_BYTES = 10 << 20
"""More than two READ_BLOCK_BYTES (4 MiB) blocks: the store is killed before the second block's GET."""
PART_SIZE_BYTES = 64 << 10
MIRROR_OBJECT_BYTES = 24 << 20
"""A run-dir object big enough that its download is under way when the watcher kills the store."""
DOC_FILES = sorted(path for path in Path("/usr/share/doc").glob("*/copyright") if path.is_file())[:40]


@pytest.fixture(scope="module")
def restartable_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A server of this module's own (~4 s to start), since its tests kill it; the AWS variables point at it."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs-faults"))
    with pytest.MonkeyPatch.context() as patch:
        try:
            server.start()
            for name, value in s3_environment(server.endpoint).items():
                patch.setenv(name, value)
            clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            yield server
        finally:
            server.kill()  # its data is temporary: no need to wait for an orderly stop
            clear_instance_cache()
    clear_instance_cache()  # the session's server, if any, is used again by the next module


def write_corpus(folder: Path, with_big_object: bool = True) -> Path:
    """Python files (small parts) and one JSONL object of BIG_OBJECT_BYTES (a part of its own)."""
    (folder / "code").mkdir(parents=True)
    (folder / "records").mkdir()
    for source in sorted((STDLIB / "json").glob("*.py")):
        shutil.copyfile(source, folder / "code" / source.name)
    texts = [path.read_text(errors="replace") for path in DOC_FILES]
    (folder / "records/small.jsonl").write_text("".join(json.dumps({"id": str(path), "text": text}) + "\n"
                                                        for path, text in zip(DOC_FILES, texts, strict=True)))
    if not with_big_object:
        return folder
    with open(folder / "records/big.jsonl", "w") as out:
        line_no = 0
        while out.tell() < BIG_OBJECT_BYTES:
            out.write(json.dumps({"id": f"r{line_no}", "text": f"{line_no}: {texts[line_no % len(texts)]}"}) + "\n")
            line_no += 1
    return folder


def write_manifest(path: Path, root: str) -> Path:
    """``on_error: skip``: even so, a store that went away must fail the part, never become a reject."""
    sources = [{"name": "code", "path": f"{root}/code", "format": "text", "glob": "*.py", "on_error": "skip"},
               {"name": "records", "path": f"{root}/records", "format": "jsonl", "id_field": "id",
                "on_error": "skip"}]
    path.write_text(yaml.safe_dump({"name": "faults", "sources": sources}))
    return path


def ingest_all(manifest: Path, run: Path) -> None:
    paths = RunPaths(run)
    for part in plan_ingest([manifest], paths, PART_SIZE_BYTES):
        ingest_part(part, 0.1, paths)


def outputs(run: Path) -> dict[str, bytes]:
    """Every document and reject Parquet file and the plan, by path: what a re-run must reproduce byte for byte."""
    files = [*run.glob("docs/part-*.parquet"), *run.glob("rejects/*.parquet"), run / "docs/plan.json"]
    return {str(path.relative_to(run)): path.read_bytes() for path in sorted(files)}


def uploaded(tmp_path: Path, name: str, with_big_object: bool = True) -> tuple[Path, Path]:
    """The corpus on disk and in the bucket, and the manifest naming the bucket's copy."""
    corpus = write_corpus(tmp_path / "corpus", with_big_object)
    url = f"s3://{BUCKET}/{name}"
    s3fs.S3FileSystem().put(f"{corpus}/", f"{url}/", recursive=True)
    return corpus, write_manifest(tmp_path / "remote.yaml", url)


class KillBeforeFetch(logging.Filter):
    """Kills the server as s3fs is about to GET a later block of ``key`` (its ``Fetch:`` debug line): mid-object,
    at the same byte on every run, with no sleep guessing when the read is under way."""

    def __init__(self, server: SeaweedServer, key: str) -> None:
        super().__init__()
        self.server, self.key, self.killed = server, key, False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not self.killed and message.startswith("Fetch: ") and self.key in message \
                and not message.endswith(", 0-" + message.rsplit("-", 1)[-1]):
            self.killed = True
            self.server.kill()
        return True


def test_a_store_killed_mid_object_then_restarted_rerun_equals_an_uninterrupted_run(
        tmp_path: Path, restartable_s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch):
    server = restartable_s3
    _, manifest = uploaded(tmp_path, "drill")
    ingest_all(manifest, tmp_path / "run-uninterrupted")

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # fail fast while the store is down
    clear_instance_cache()
    paths = RunPaths(tmp_path / "run")
    parts = plan_ingest([manifest], paths, PART_SIZE_BYTES)
    [big] = [part for part in parts if part.files == ("big.jsonl",)]
    assert parts.index(big) > 0
    killer = KillBeforeFetch(server, "big.jsonl")
    s3fs_logger = logging.getLogger("s3fs")
    s3fs_logger.filters.insert(0, killer)
    try:
        with pytest.raises(ObjectStoreError) as err:
            for part in parts:
                ingest_part(part, 0.1, paths)
    finally:
        s3fs_logger.removeFilter(killer)
    assert killer.killed
    message = str(err.value)
    assert message.startswith(f"s3://{BUCKET}/drill/records/big.jsonl: ") and "\n" not in message, message
    assert "AWS_ENDPOINT_URL" in message or "run again" in message
    assert isinstance(err.value, StoreUnavailableError) and err.value.retryable  # a flow task retries it
    assert not part_finished(paths, big.part_id)  # no marker, no half a part: the re-run reads it again
    assert not (paths.docs / f"part-{big.part_id:05d}.parquet").exists()
    assert all(part_finished(paths, part.part_id) for part in parts[:parts.index(big)])

    server.start()  # the same data folder and ports: the same buckets at the same endpoint
    clear_instance_cache()  # as a new process would
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    remaining = plan_ingest([manifest], paths, PART_SIZE_BYTES)
    assert [part.part_id for part in remaining] == [part.part_id for part in parts[parts.index(big):]]
    for part in remaining:
        ingest_part(part, 0.1, paths)
    expected = outputs(tmp_path / "run-uninterrupted")
    assert f"docs/part-{big.part_id:05d}.parquet" in expected and outputs(tmp_path / "run") == expected


def test_a_store_down_at_the_start_of_a_read_and_back_within_the_retries_is_survived(
        tmp_path: Path, restartable_s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture):
    server = restartable_s3
    _, manifest = uploaded(tmp_path, "outage", with_big_object=False)
    ingest_all(manifest, tmp_path / "run-uninterrupted")
    paths = RunPaths(tmp_path / "run")
    [first, *_] = plan_ingest([manifest], paths, PART_SIZE_BYTES)

    # Standard mode: up to 20 s a wait, far more than the ~4 s the server takes to come back.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "12")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    clear_instance_cache()
    caplog.set_level(logging.WARNING, logger="pipeline.objects")
    server.kill()
    failure: list[BaseException] = []
    first_retry = threading.Event()

    def ingest_first() -> None:
        try:
            ingest_part(first, 0.1, paths)
        except BaseException as err:  # handed to the test thread, which fails on it
            failure.append(err)
        finally:
            first_retry.set()

    handler = _EventOnRecord(first_retry)
    logging.getLogger("pipeline.objects").addHandler(handler)
    worker = threading.Thread(target=ingest_first)
    try:
        worker.start()
        assert first_retry.wait(60), "no retry was logged"
        server.start(wait=False)  # back after the first retry: within the retry window
        worker.join(120)
    finally:
        logging.getLogger("pipeline.objects").removeHandler(handler)
    assert not worker.is_alive() and not failure, failure
    assert part_finished(paths, first.part_id)
    expected = outputs(tmp_path / "run-uninterrupted")
    name = f"docs/part-{first.part_id:05d}.parquet"
    assert (paths.root / name).read_bytes() == expected[name]

    retries = [record.getMessage() for record in caplog.records if record.name == "pipeline.objects"]
    assert retries and all("transient error" in line and f"/{BUCKET}/outage/" in line for line in retries)
    # Each retry logged once: each call's retries counted 1, 2, ... with none repeated or skipped.
    numbers = [int(line.split("; retry ")[1].split()[0]) for line in retries]
    assert all(number in (1, before + 1) for before, number in zip([0, *numbers], numbers, strict=False)), retries
    assert all(" in " in line.rsplit(";", 1)[1] for line in retries)  # each names its wait


class _EventOnRecord(logging.Handler):
    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()


def test_a_mirror_cut_mid_object_leaves_no_partial_file_and_the_next_mirror_completes(
        tmp_path: Path, restartable_s3: SeaweedServer, monkeypatch: pytest.MonkeyPatch):
    server = restartable_s3
    run = build_query_run(tmp_path / "run")
    (run / "metrics/big.bin").write_bytes(np.random.default_rng(0).bytes(MIRROR_OBJECT_BYTES))  # ~0.1 s to fetch
    url = f"s3://{BUCKET}/runs/mirrored"
    s3fs.S3FileSystem().put(f"{run}/", f"{url}/", recursive=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    clear_instance_cache()
    partial = mirror_root(url) / "metrics" / f"{TEMP_PREFIX}big.bin"
    stop_watching = threading.Event()

    def kill_once_the_download_has_begun() -> None:  # polls the file the download writes: no guessed sleep
        while not stop_watching.is_set():
            if partial.exists() and partial.stat().st_size > 0:
                server.kill()
                return
            stop_watching.wait(0.001)

    watcher = threading.Thread(target=kill_once_the_download_has_begun)
    watcher.start()
    try:
        with pytest.raises(ObjectStoreError) as err:
            mirror_run(url)
    finally:
        stop_watching.set()
        watcher.join()
    assert server.process is None, "the store was not killed mid-download"
    assert str(err.value).startswith(f"{url}/metrics/big.bin: ") and "\n" not in str(err.value)
    assert isinstance(err.value, StoreUnavailableError)
    local = {str(path.relative_to(run)): path.read_bytes() for path in run.rglob("*") if path.is_file()}
    held = {str(path.relative_to(mirror_root(url))): path.read_bytes()
            for path in mirror_root(url).rglob("*") if path.is_file()}
    assert held.items() <= local.items(), sorted(set(held) - set(local))  # what is there is whole; no partial file

    server.start()
    clear_instance_cache()
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    mirrored = mirror_run(url)
    assert {str(path.relative_to(mirrored)): path.read_bytes()
            for path in mirrored.rglob("*") if path.is_file()} == local


@pytest.mark.parametrize(("code", "status"), [("SlowDown", 503), ("InternalError", 500), ("ServiceUnavailable", 503)])
def test_a_store_still_failing_after_retries_is_one_retryable_line(code: str, status: int):
    """SeaweedFS cannot be made to answer 503: botocore's own ClientError, translated by s3fs as a read sees it."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    answer = {"Error": {"Code": code, "Message": "Please reduce your request rate."},
              "ResponseMetadata": {"HTTPStatusCode": status}}
    error = object_store_error("s3://bucket/corpus/a.jsonl", translate_boto_error(ClientError(answer, "GetObject")))
    assert isinstance(error, StoreUnavailableError), error
    message = str(error)
    assert message.startswith("s3://bucket/corpus/a.jsonl: the object store is overloaded or failing")
    assert "AWS_MAX_ATTEMPTS" in message and "\n" not in message
