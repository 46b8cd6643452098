"""Benchmark: the ``consumed`` view derived from the launch records vs read back from a per-row log, and what
``train.log_row_losses`` costs a training step.

Derived (ours): a synthetic run's ``metrics/train_segments.jsonl`` (two launches: 2 processes, then a resume on 1
halfway, over many shards) is replayed by :func:`trainer.metrics.consumed.consumed_table`. Logged (baseline, what a
trainer that logs its data order would do): one JSONL line per step and rank with the row ids, as the loader's test hook
writes them, parsed back into the same columns. Both are timed building the table (samples/s, best of the
rounds); the bytes each keeps on disk are printed too. The JSON line is ours / baseline in samples/s.

Row losses: the same TrainingLoop step (tiny preset, standard-library rows) with and without writing per-row
losses, alternating rounds, median step in CPU seconds (a shared machine swings wall time far more).

    python -m benchmarks.consumed --quick     # seconds
    python -m benchmarks.consumed             # 20k steps x 256 samples; a minute or two
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks.document_masking import build_loop, packed_stdlib_rows
from benchmarks.result import print_result
from core.rundir import RunPaths
from core.schemas import CONSUMED_SCHEMA
from trainer.config import TrainConfig
from trainer.loader.batches import BatchLayout, ShardNumbering, TrainLoader
from trainer.loop import seed_everything
from trainer.metrics.consumed import consumed_table
from trainer.metrics.segments import RowLossLog, append_segment, segment_record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of the run (default 20000, quick 200)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 32, quick 4")
    parser.add_argument("--shards", type=int, default=None, help="train shards (default 64, quick 4)")
    parser.add_argument("--rows-per-shard", type=int, default=None, help="default 50000, quick 500")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, quick 1)")
    parser.add_argument("--steps-per-round", type=int, default=None, help="training steps per round (default 4)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    args = parser.parse_args(argv)
    defaults = {"steps": (200, 20000), "micro_batch_size": (4, 32), "shards": (4, 64),
                "rows_per_shard": (500, 50000), "rounds": (1, 3), "steps_per_round": (1, 4)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def write_history(run_dir: Path, args: argparse.Namespace) -> ShardNumbering:
    """Two launch records (2 processes x 2 micro-batches, then 1 process from the middle) and the last train row."""
    paths = RunPaths(run_dir)
    shards = [f"shards/split=train/source=s{n % 3}/part-{n:05d}.arrow" for n in range(args.shards)]
    numbering = ShardNumbering(shards, [f"s{n % 3}" for n in range(args.shards)], [args.rows_per_shard] * args.shards,
                               {path: f"{n:064x}" for n, path in enumerate(shards)})
    half = args.steps // 2
    for start_step, world_size in ((0, 2), (half, 1)):
        loader = TrainLoader(numbering, BatchLayout(args.micro_batch_size, 2, world_size), seed=0)
        loader.samples_consumed = half * args.micro_batch_size * 4 if start_step else 0
        no_mixture = {"mixture": None, "mixture_schedule": None}
        append_segment(paths, segment_record(loader, start_step, world_size, no_mixture))
    paths.append_text(paths.metrics / "train.jsonl", json.dumps({"step": args.steps, "loss": 1.0}) + "\n")
    return numbering


def write_row_log(path: Path, numbering: ShardNumbering, args: argparse.Namespace) -> None:
    """The baseline's log: every step's rows per rank, one JSON line each (the loader's test-hook format)."""
    half = args.steps // 2
    with open(path, "w", encoding="utf-8") as log:
        for start_step, world_size, steps in ((0, 2, half), (half, 1, args.steps - half)):
            loader = TrainLoader(numbering, BatchLayout(args.micro_batch_size, 2, world_size), seed=0)
            loader.samples_consumed = half * args.micro_batch_size * 4 if start_step else 0
            for step in range(start_step + 1, start_step + steps + 1):
                first = loader.samples_consumed
                for rank, rows in enumerate(loader.next_steps_rows(1)[0]):
                    log.write(json.dumps({"step": step, "sample": first + rank * len(rows), "rank": rank,
                                          "micro_batch_size": args.micro_batch_size,
                                          "rows": rows.tolist()}) + "\n")


def table_from_row_log(path: Path, numbering: ShardNumbering) -> pa.Table:
    """The baseline: the logged rows parsed back into consumed's main columns."""
    columns: dict[str, list[np.ndarray]] = {name: [] for name in ("step", "micro_step", "rank", "batch_row", "sample",
                                                                  "shard", "row_in_shard")}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        rows = np.asarray(record["rows"], dtype=np.int64)
        index = np.arange(len(rows))
        shard, row_in_shard = numbering.locate(rows)
        for name, values in (("step", np.full(len(rows), record["step"])), ("rank", np.full(len(rows), record["rank"])),
                             ("micro_step", index // record["micro_batch_size"]),
                             ("batch_row", index % record["micro_batch_size"]), ("sample", record["sample"] + index),
                             ("shard", shard), ("row_in_shard", row_in_shard)):
            columns[name].append(values)
    merged = {name: np.concatenate(parts) for name, parts in columns.items()}
    shard_paths = pa.array(numbering.shard_paths)
    merged["shard_path"] = pa.DictionaryArray.from_arrays(merged.pop("shard").astype(np.int32), shard_paths)
    return pa.table(merged)


def best_rate(build: Callable[[], object], num_samples: int, rounds: int) -> float:
    """Samples per second of the fastest of ``rounds`` calls of ``build``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        build()
        best = min(best, time.perf_counter() - start)
    return num_samples / best


def row_loss_overhead(args: argparse.Namespace) -> dict[str, float]:
    """Median CPU seconds per training step without and with per-row losses (tiny preset, stdlib rows)."""
    rows = packed_stdlib_rows(0.1, 512, 64)
    train = TrainConfig(micro_batch_size=4, max_steps=1000)
    seed_everything(train.seed)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        loops = {name: build_loop(rows, train, 512, Path(scratch), masking=False) for name in times}
        loops["on"].row_losses = RowLossLog(RunPaths(Path(scratch)), 0, 0, train.micro_batch_size)
        for loop in loops.values():
            loop.train_step()
        for _ in range(args.rounds):
            for name, loop in loops.items():
                for _ in range(args.steps_per_round):
                    start = time.process_time()
                    loop.train_step()
                    times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        run_dir = Path(scratch) / "run"
        numbering = write_history(run_dir, args)
        derived = consumed_table(run_dir)
        num_samples = derived.num_rows
        assert derived.schema == CONSUMED_SCHEMA
        log = Path(scratch) / "rows.jsonl"
        write_row_log(log, numbering, args)
        logged = table_from_row_log(log, numbering)
        assert logged.column("sample").to_pylist() == derived.column("sample").to_pylist()
        assert logged.column("row_in_shard").to_pylist() == derived.column("row_in_shard").to_pylist()
        ours = best_rate(lambda: consumed_table(run_dir), num_samples, args.rounds)
        baseline = best_rate(lambda: table_from_row_log(log, numbering), num_samples, args.rounds)
        record_bytes = (run_dir / "metrics" / "train_segments.jsonl").stat().st_size
        log_bytes = log.stat().st_size
    step_s = row_loss_overhead(args)
    print(f"{args.steps} steps, {num_samples:,} samples over {args.shards} shards x {args.rows_per_shard} rows, "
          "2 launches (2 processes, then 1)")
    print(f"derived from train_segments.jsonl ({record_bytes:,} bytes): {ours:14,.0f} samples/s")
    print(f"read from a per-row log ({log_bytes:,} bytes):       {baseline:14,.0f} samples/s")
    print(f"train step, CPU s (median): row losses off {step_s['off']:.4f}, on {step_s['on']:.4f} "
          f"({100 * (step_s['on'] / step_s['off'] - 1):+.1f}%)")
    return print_result("consumed", ours, baseline, "samples/s")


if __name__ == "__main__":
    main()
