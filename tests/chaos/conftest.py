"""Chaos fixtures: a small real corpus with planted duplicates and broken records, a recipe over it, and
helpers to run the ``tokenmill`` console script against the session's Prefect test server."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from core.files.atomic import TEMP_PREFIX
from core.rundir import RunPaths
from core.shards.store import ShardInfo
from flows.recipe import load_recipe, manifest_paths, record_recipe, tokenizer_file
from flows.run_sql import run_query
from pipeline.dedupe.summary import dedupe_stage
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.manifest import load_manifest
from tests.conftest import STDLIB, copy_stdlib_slice
from tests.flows.conftest import prefect_server
from tokenization.stage import pack_split_source, write_index
from tokenization.train_tokenizer import prepare_tokenizer

__all__ = ["prefect_server"]  # re-exported: pytest finds the session fixture through this conftest

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
WORDS = ("the", "data", "model", "token", "shard", "record", "stream", "parser", "window", "budget",
         "archive", "signal", "river", "garden", "lantern", "market", "harbor", "engine", "summer", "violet")
NUM_GOOD_RECORDS = 60
"""Valid jsonl records planted in records/good.jsonl (plus NUM_GZ_RECORDS in records/more.jsonl.gz)."""
NUM_GZ_RECORDS = 20
BROKEN_LINES = (b'{"text": "an unterminated string\n', b"[1, 2, 3]\n", b'{"body": "no text field here"}\n',
                b'{"text": 12345}\n', b'{"text": "caf\xc3\x28 invalid utf-8 bytes"}\n', b'{"text": "   "}\n')
"""One of each broken-record kind: invalid_json, not_an_object, missing_text, non_string_text, invalid_utf8, empty."""
DIMS = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}
TRAIN = {"max_steps": 40, "micro_batch_size": 16, "lr": 0.01, "warmup_steps": 5, "checkpoint_every": 5,
         "eval_every": 10, "eval_batches": 2, "log_every": 1, "keep_last": 2, "tensorboard": False}


def record_text(rng: random.Random, number: int) -> str:
    """A plausible prose record that passes the default quality filters (unique by its number)."""
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                 for _ in range(rng.randint(3, 8))]
    return f"Record number {number}. " + " ".join(sentences)


def write_jsonl(path: Path, texts: list[str], extra_lines: tuple[bytes, ...] = ()) -> None:
    lines = [json.dumps({"text": text, "id": f"{path.stem}-{i}"}).encode() + b"\n" for i, text in enumerate(texts)]
    payload = b"".join(lines[:len(lines) // 2]) + b"".join(extra_lines) + b"".join(lines[len(lines) // 2:])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload, mtime=0) if path.suffix == ".gz" else payload)


def build_chaos_corpus(root: Path) -> Path:
    """``root/corpus``: stdlib text files (+ an exact and a near copy) and jsonl records (+ copies, broken lines).

    Records: 34 stdlib files + 2 copies, NUM_GOOD_RECORDS + 3 exact copies + 6 broken lines in good.jsonl,
    NUM_GZ_RECORDS in more.jsonl.gz (see :func:`planted_records`).
    """
    corpus = root / "corpus"
    copy_stdlib_slice(corpus / "text", ("json", "email"))
    copies = corpus / "text" / "copies"
    copies.mkdir()
    shutil.copyfile(STDLIB / "json" / "decoder.py", copies / "decoder_renamed.py")  # exact copy, new name
    near = (STDLIB / "email" / "quoprimime.py").read_text().replace("def ", "def  ", 3) + "\n# one more line\n"
    (copies / "quoprimime_edited.py").write_text(near)  # near copy
    rng = random.Random(7)
    texts = [record_text(rng, number) for number in range(NUM_GOOD_RECORDS)]
    write_jsonl(corpus / "records" / "good.jsonl", [*texts, texts[3], texts[10], texts[42]], BROKEN_LINES)
    write_jsonl(corpus / "records" / "more.jsonl.gz",
                [record_text(rng, number) for number in range(1000, 1000 + NUM_GZ_RECORDS)])
    return corpus


def planted_records(corpus: Path) -> int:
    """Every record planted under ``corpus``: one per text file, one per non-blank jsonl line."""
    count = len(list((corpus / "text").rglob("*.py")))
    for path in sorted((corpus / "records").glob("*.jsonl*")):
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        count += sum(1 for line in data.split(b"\n") if line.strip())
    return count


def write_chaos_recipe(root: Path, corpus: Path, *, train: dict[str, Any] | None = None,
                       pack: dict[str, Any] | None = None, name: str = "recipe.yaml") -> Path:
    """A recipe (and manifest) over :func:`build_chaos_corpus`: several ingest parts, many small shards."""
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({
        "name": "chaos",
        "sources": [
            {"name": "code", "path": os.path.relpath(corpus / "text", root), "format": "text", "glob": "**/*.py"},
            {"name": "notes", "path": os.path.relpath(corpus / "records", root), "format": "jsonl",
             "glob": "*.jsonl*", "id_field": "id"},
        ],
        "filters": {"min_chars": 20},
    }))
    recipe = root / name
    recipe.write_text(yaml.safe_dump({
        "name": "chaos",
        "data": {"manifests": ["manifest.yaml"], "val_fraction": 0.1, "part_size_bytes": 60_000},
        "dedupe": {"near": {"enabled": True, "threshold": 0.8, "num_perm": 64, "ngram": 5}},
        "tokenizer": {"vocab_size": 512},
        "pack": {"seq_len": 64, "rows_per_shard": 96, **(pack or {})},
        "model": {"preset": None, "dims": DIMS},
        "train": {**TRAIN, **(train or {})},
        "eval": {"enabled": False},  # the full evaluation has tests of its own (tests/trainer/test_full_eval.py)
    }))
    return recipe


def run_data_stages(recipe: Path, run_dir: Path) -> list[ShardInfo]:
    """What the prepare-data flow does, stage by stage without Prefect: run.yaml, ingest, dedupe, tokenizer, pack."""
    loaded, base = load_recipe(recipe)
    paths = RunPaths(run_dir)
    with paths.lock():
        record_recipe(loaded, base, run_dir)
        manifests = manifest_paths(loaded, base)
        for part in plan_ingest(manifests, paths, loaded.data.part_size_bytes):
            ingest_part(part, loaded.data.val_fraction, paths)
        dedupe_stage(paths, loaded.dedupe)
        prepare_tokenizer(paths, loaded.tokenizer, tokenizer_file(loaded, base))
        return pack_and_index(recipe, run_dir)


def pack_and_index(recipe: Path, run_dir: Path) -> list[ShardInfo]:
    """The pack stage of every (split, source) pair, then the shard index (as the flow orders them)."""
    loaded, base = load_recipe(recipe)
    paths = RunPaths(run_dir)
    for split in ("train", "val"):
        for manifest in manifest_paths(loaded, base):
            for source in load_manifest(manifest).sources:
                pack_split_source(paths, split, source.name, loaded.pack)
    return write_index(paths)


# ---- running the CLI ------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cli_env(prefect_server: None) -> dict[str, str]:
    """Environment for ``tokenmill`` subprocesses: the session's Prefect test server instead of a
    temporary one per command (saves ~6 s of server start-up per call)."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PYTHONUNBUFFERED": "1"}


def tokenmill(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 300,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the console script to completion; stdout and stderr are kept apart."""
    return subprocess.run([TOKENMILL, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=cwd)


@dataclass
class LiveCommand:
    """A ``tokenmill`` subprocess in its own session whose merged output is read line by line."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    _matched: threading.Event = field(default_factory=threading.Event)
    _pattern: Callable[[list[str]], bool] | None = None

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout_s: float = 240) -> bool:
        """Block until ``predicate(lines so far)`` holds; False when the process ended first."""
        self._pattern = predicate
        if predicate(list(self.lines)):
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._matched.wait(0.05):
                return True
            if self.process.poll() is not None and not self._reader.is_alive():
                return predicate(list(self.lines))
        raise AssertionError(f"no matching output in {timeout_s} s; last lines: {self.lines[-5:]}")

    def start_reading(self) -> None:
        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                if self._pattern is not None and self._pattern(self.lines):
                    self._matched.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill_group(self) -> None:
        """SIGKILL the command's whole process group (what ``kill -9 -PGID`` or an OOM kill of a job does)."""
        os.killpg(self.process.pid, signal.SIGKILL)

    def finish(self, timeout_s: float = 300) -> int:
        returncode = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=30)
        return returncode


def start_tokenmill(*args: str | Path, env: dict[str, str]) -> LiveCommand:
    process = subprocess.Popen([TOKENMILL, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, env=env, start_new_session=True)
    command = LiveCommand(process)
    command.start_reading()
    return command


def wait_gone(processes: list[psutil.Process], timeout_s: float = 60) -> list[psutil.Process]:
    """Wait for ``processes`` to exit; return those still alive after ``timeout_s``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return alive


# ---- inspecting a run dir -----------------------------------------------------------------------


def temp_leftovers(run_dir: Path) -> list[str]:
    """Every file or folder in the run dir whose name marks an unfinished atomic write."""
    return sorted(path.relative_to(run_dir).as_posix() for path in run_dir.rglob(f"{TEMP_PREFIX}*"))


def table_rows(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """documents, duplicates and rejects of a run, fully ordered (row order of the files does not matter)."""
    return {
        "documents": run_query(run_dir, "SELECT * FROM documents ORDER BY doc_id").to_pylist(),
        "duplicates": run_query(run_dir, "SELECT * FROM duplicates ORDER BY doc_id").to_pylist(),
        "rejects": run_query(run_dir, "SELECT * FROM rejects ORDER BY source, uri, reason").to_pylist(),
    }


def file_bytes(run_dir: Path, patterns: tuple[str, ...]) -> dict[str, bytes]:
    """``{relative path: bytes}`` of the files matching ``patterns`` (globs relative to the run dir); temporary
    files of unfinished writes are left out (:func:`temp_leftovers` looks for those), and so are the commands'
    seals (``stages/sealed/``: they name files by mtime and inode, not by content)."""
    return {path.relative_to(run_dir).as_posix(): path.read_bytes()
            for pattern in patterns for path in sorted(run_dir.glob(pattern))
            if path.is_file() and not path.name.startswith(TEMP_PREFIX)
            and not path.relative_to(run_dir).as_posix().startswith("stages/sealed/")}


DATA_ARTIFACTS = ("run.yaml", "docs/*", "rejects/*", "dedupe/*.parquet", "dedupe/state.json", "tokenizer/*",
                  "shards/**/*.arrow", "shards/**/state.json", "shards/index.parquet", "stages/**/*.json")
"""Data-stage outputs promised to be deterministic (same input and settings -> same bytes)."""


def funnel_total(run_dir: Path) -> int:
    """documents + duplicates + rejects: every planted record must be in exactly one of them."""
    counts = run_query(run_dir, "SELECT (SELECT count(*) FROM documents) + (SELECT count(*) FROM duplicates) "
                                "+ (SELECT count(*) FROM rejects) AS n").column(0).to_pylist()
    return int(counts[0])
