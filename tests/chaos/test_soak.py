"""Twenty small refresh cycles back to back: new files (a renamed copy now and then, a broken record now and then),
the prepare-data flow, two more training steps. After every cycle the run must still add up, and the process
that ran all of it (flows and trainer in one process) must not keep growing."""

from __future__ import annotations

import gc
import gzip
import json
import random
import shutil
from pathlib import Path

import psutil
import pytest
from accelerate.state import AcceleratorState, GradientState

from core.shards.store import verify_shards
from tests.chaos.conftest import funnel_total, record_text, temp_leftovers, write_chaos_recipe
from tests.conftest import STDLIB
from trainer.checkpoint.checkpointer import list_checkpoints
from trainer.metrics.sink import read_metric_rows
from trainer.train import train

pytestmark = pytest.mark.slow

NUM_CYCLES = 20
FILES_PER_CYCLE = 3
STEPS_PER_CYCLE = 2
KEEP_LAST = 2
POOL_PACKAGES = ("logging", "http", "urllib", "importlib", "concurrent", "wsgiref", "xmlrpc", "dbm", "html",
                 "sqlite3", "zoneinfo", "tomllib", "json", "email")
RSS_MARGIN_BYTES = 40 << 20
"""Cycle 20 may hold this much more resident memory than cycle 5 (allocator noise, more shards mapped)."""
BYTES_PER_INPUT_BYTE = 4
"""Non-checkpoint run-dir bytes per input byte at most: documents, rejects, dedupe caches, shards and index."""
FIXED_BYTES = 2 << 20
"""Run-dir bytes independent of the data: tokenizer, exported model, metrics, run.yaml, stage markers."""


def source_pool() -> list[Path]:
    """Standard-library files to feed in, a few per cycle (big files left out to keep cycles fast)."""
    files = [path for package in POOL_PACKAGES for path in sorted((STDLIB / package).rglob("*.py"))
             if 200 < path.stat().st_size < 40_000]
    assert len(files) >= NUM_CYCLES * FILES_PER_CYCLE
    return files


def plant_cycle(corpus: Path, cycle: int, pool: list[Path], planted: list[Path]) -> int:
    """Add this cycle's files; return how many records they hold."""
    folder = corpus / "text" / f"cycle-{cycle:02d}"
    folder.mkdir(parents=True)
    for source in pool[(cycle - 1) * FILES_PER_CYCLE: cycle * FILES_PER_CYCLE]:
        target = folder / f"{source.parent.name}_{source.name}"
        shutil.copyfile(source, target)
        planted.append(target)
    records = FILES_PER_CYCLE
    if cycle % 4 == 0:  # a renamed copy of an earlier file: an exact duplicate
        shutil.copyfile(planted[cycle], folder / f"renamed_{planted[cycle].name}")
        records += 1
    if cycle % 5 == 0:  # a few new records and one broken line
        lines = [json.dumps({"text": record_text(random.Random(cycle), cycle * 100 + n)})
                 for n in range(3)]
        payload = "\n".join([lines[0], '{"text": "cut off', *lines[1:]]) + "\n"
        (corpus / "records" / f"cycle-{cycle:02d}.jsonl.gz").write_bytes(gzip.compress(payload.encode(), mtime=0))
        records += 4
    return records


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def train_steps(run_dir: Path, until_step: int) -> None:
    AcceleratorState._reset_state(reset_partial_state=True)  # trainer.train builds its own Accelerator
    GradientState._reset_state()
    train(run_dir, until_step)


def test_twenty_refresh_cycles_keep_the_run_consistent(tmp_path: Path, prefect_server: None) -> None:
    from flows.pipeline import prepare_data

    corpus = tmp_path / "corpus"
    (corpus / "text").mkdir(parents=True)
    (corpus / "records").mkdir()
    (corpus / "records" / "seed.jsonl").write_text(json.dumps({"text": record_text(random.Random(0),
                                                                                    0)}) + "\n")
    recipe = write_chaos_recipe(tmp_path, corpus, train={"max_steps": 1000, "steps_per_refresh": STEPS_PER_CYCLE,
                                                         "checkpoint_every": 1000, "eval_every": 10,
                                                         "keep_last": KEEP_LAST, "micro_batch_size": 8})
    run_dir = tmp_path / "run"
    pool, planted_files = source_pool(), []
    planted_records = 1
    rss: dict[int, int] = {}
    process = psutil.Process()
    for cycle in range(1, NUM_CYCLES + 1):
        planted_records += plant_cycle(corpus, cycle, pool, planted_files)
        prepare_data(str(recipe), str(run_dir))
        train_steps(run_dir, STEPS_PER_CYCLE * cycle)

        where = f"cycle {cycle}"
        assert funnel_total(run_dir) == planted_records, where
        assert verify_shards(run_dir) == [], where
        steps = [row["step"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")]
        assert steps == list(range(1, STEPS_PER_CYCLE * cycle + 1)), where
        eval_path = run_dir / "metrics" / "eval.jsonl"  # absent while no document has landed in split=val
        eval_steps = [row["step"] for row in read_metric_rows(eval_path)] if eval_path.is_file() else []
        assert eval_steps == sorted(set(eval_steps)), where
        assert temp_leftovers(run_dir) == [], where
        checkpoints = list_checkpoints(run_dir / "checkpoints")
        assert [step for step, _ in checkpoints] == \
            [STEPS_PER_CYCLE * c for c in range(max(1, cycle - KEEP_LAST + 1), cycle + 1)], where
        one_checkpoint = folder_bytes(checkpoints[-1][1])
        assert folder_bytes(run_dir / "checkpoints") <= KEEP_LAST * one_checkpoint + 4096, where
        data_bytes = folder_bytes(run_dir) - folder_bytes(run_dir / "checkpoints")
        assert data_bytes <= BYTES_PER_INPUT_BYTE * folder_bytes(corpus) + FIXED_BYTES, where
        gc.collect()
        rss[cycle] = process.memory_info().rss

    growth = rss[NUM_CYCLES] - rss[5]
    assert growth <= RSS_MARGIN_BYTES, f"RSS grew {growth / 2**20:.1f} MiB from cycle 5 to {NUM_CYCLES}: {rss}"
