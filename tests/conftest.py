"""Test-wide settings: offline, isolated Prefect home, a small real corpus from the standard library."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.rundir import RunPaths
from core.schemas import ATTRIBUTES_SCHEMA, DOCUMENTS_SCHEMA, DUPLICATES_SCHEMA, REJECTS_SCHEMA
from core.shards.store import ShardRows, write_shard, write_shard_index

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def pytest_configure(config: pytest.Config) -> None:
    home = Path(tempfile.mkdtemp(prefix="tokenmill-prefect-home-"))
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


THREAD_COUNT_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")
"""Dask's ``distributed.nanny.pre-spawn-environ``, which a Nanny started in this process (tests/flows/test_dask.py's
LocalCluster) writes into os.environ ("this leaks variables into the nanny process", its config says), so every
process a later test starts inherited them. OMP_NUM_THREADS=1: the launcher keeps a user's value, so trainers ran on
one core of two. MALLOC_TRIM_THRESHOLD_=65536: glibc hands freed memory back to the kernel at once, and a training
step, which frees and reallocates its activations, then spent 2-3x the time (much of it in the kernel: measured
on 20 steps of the quick start's model, median step 3.0/5.0 s against 1.6/1.9 s without, on a loaded machine); the
quick start trained 200 steps in 206 s inside the test session against ~115 s outside it."""
_SESSION_THREAD_COUNTS = {name: os.environ.get(name) for name in THREAD_COUNT_VARIABLES}


@pytest.fixture(autouse=True)
def _thread_counts_as_the_session_began() -> Iterator[None]:
    """Undo a test's (or a library's) change of those variables before the next test runs."""
    yield
    for name, value in _SESSION_THREAD_COUNTS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SeaweedFS S3 server for the session (started once, ~10 s), with the AWS variables pointing at it."""
    from tests.s3_server import clear_instance_cache, running_s3_server, s3_environment

    with running_s3_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint, pytest.MonkeyPatch.context() as patch:
        for name, value in s3_environment(endpoint).items():
            patch.setenv(name, value)
        clear_instance_cache()
        yield endpoint
    clear_instance_cache()


@pytest.fixture
def s3_prefix(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    """An empty prefix of the session's bucket for one test: ``s3://tokenmill-tests/<test name>``.

    One bucket for all: SeaweedFS gives each bucket volumes of its own, and a few buckets exhaust a small server.
    """
    import re

    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists("tokenmill-tests"):
        fs.mkdir("tokenmill-tests")
    return "s3://tokenmill-tests/" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())


def copy_stdlib_slice(target: Path, packages: tuple[str, ...] = ("json", "email", "logging", "http")) -> Path:
    """Copy a few standard-library packages' .py files into ``target`` (a real, small corpus)."""
    for package in packages:
        for source in sorted((STDLIB / package).rglob("*.py")):
            destination = target / package / source.relative_to(STDLIB / package)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
    return target


def finish_docs_part(run_dir: Path, part_id: int) -> None:
    """Mark ``docs/part-NNNNN.parquet`` finished: its ingest marker, as the ingest stage writes it (format 2, with
    the fingerprint of its kept documents, here made up: what the stages after ingest key on)."""
    marker = RunPaths(run_dir).marker("ingest", f"part-{part_id:05d}")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"format": 2, "fingerprint": f"{part_id}", "inputs": {}, "summary": {},
                                  "documents": f"documents of part {part_id}"}))


def build_query_run(run: Path) -> Path:
    """A hand-built run dir with one row or more in every view but eval_metrics (hermetic query tests)."""
    (run / "docs").mkdir(parents=True)
    docs = pa.table({"doc_id": [1, 2, 3], "source": ["a", "a", "b"], "source_id": [None, None, "x"],
                     "uri": ["f.py", "g.py", "h.jsonl:1"], "text": ["one", "one", "three"],
                     "num_chars": [3, 3, 5], "content_hash": ["h1", "h1", "h3"], "split": ["train"] * 3},
                    schema=DOCUMENTS_SCHEMA)
    pq.write_table(docs, run / "docs/part-00000.parquet")
    finish_docs_part(run, 0)
    (run / "rejects").mkdir()
    pq.write_table(pa.table({"source": ["b"], "source_id": [None], "uri": ["h.jsonl:2"], "reason": ["invalid_json"],
                             "detail": ["Expecting value"], "raw": [b"{oops"], "text": [None]},
                            schema=REJECTS_SCHEMA),
                   run / "rejects/part-00000.parquet")
    (run / "attributes").mkdir()
    pq.write_table(pa.Table.from_pylist([{"doc_id": 1, "source": "a", "uri": "f.py", "num_chars": 3},
                                         {"doc_id": 4, "source": "a", "uri": "s.py", "reason": "too_short",
                                          "num_chars": 1}], schema=ATTRIBUTES_SCHEMA),
                   run / "attributes/part-00000.parquet")
    (run / "dedupe").mkdir()
    pq.write_table(pa.table({"doc_id": [2], "source": ["a"], "source_id": [None], "uri": ["g.py"],
                             "duplicate_of": [1], "kind": ["exact"], "similarity": [1.0]}, schema=DUPLICATES_SCHEMA),
                   run / "dedupe/duplicates.parquet")
    rows = ShardRows(np.arange(16, dtype=np.uint16).reshape(2, 8), [[1], [1, 3]], [[0], [0, 3]], [0, 8], [8, 8])
    info = write_shard(run, "shards/split=train/source=a/part-00000.arrow", rows, split="train", source="a",
                       tokenizer_sha256="t" * 64, vocab_size=100)
    write_shard_index(run, [info])
    (run / "metrics").mkdir()
    (run / "metrics/train.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": 5.0 - s, "lr": 0.1,
                                                                   "tokens_seen": 64 * s, "tokens_per_s": 9.0})
                                                       for s in (1, 2)) + "\n")
    return run
