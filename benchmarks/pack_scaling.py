"""``benchmarks/tokenize.py --scale``: ingest and pack at 1x and 4x of a corpus, wall time and cores busy.

Each stage runs the way ``flows/pipeline.py`` runs it: ingest parts in spawned worker processes (one per
core, through ``flows.runtime.stage_processes``) fed by a thread pool, and the (train, val) packs of the one source
on a thread pool of two. Cores busy = CPU seconds (this process plus its finished children, so the ingest
workers count once the pool is closed) / wall seconds.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.result import print_result

PART_SIZE_BYTES = 2 << 20
"""Small parts, so even 1x is a multi-part corpus (the flow's default is 32 MiB)."""
VAL_FRACTION = 0.05
SPLITS = ("train", "val")


def run_scaling(base_mb: int, rounds: int) -> dict[int, dict[str, float]]:
    """Ingest, dedupe, train a tokenizer and pack at 1x and 4x of ``base_mb``; print a table and the JSON line."""
    results = {}
    for scale in (1, 4):
        with tempfile.TemporaryDirectory(prefix="tokenmill-bench-scale-") as tmp:
            results[scale] = measure_scale(Path(tmp), base_mb * scale * 1_000_000, rounds)
    _report(results)
    return results


def measure_scale(folder: Path, num_bytes: int, rounds: int) -> dict[str, float]:
    """Every measured figure of one corpus size (best of ``rounds`` for ingest and pack)."""
    from benchmarks.ingest_memory import generate_corpus
    from core.rundir import RunPaths
    from pipeline.config import DedupeConfig
    from pipeline.dedupe.stage import dedupe_documents
    from tokenization.config import PackConfig, TokenizerConfig
    from tokenization.train_tokenizer import prepare_tokenizer

    manifest, written = generate_corpus(folder / "corpus", num_bytes, shard_bytes=PART_SIZE_BYTES)
    paths = RunPaths(folder / "run")
    dedupe = DedupeConfig()
    ingest = _best(rounds, lambda: _ingest(manifest, paths, dedupe), lambda: _forget_ingest(paths))
    dedupe_documents(paths, dedupe)
    prepare_tokenizer(paths, TokenizerConfig(vocab_size=8192, sample_bytes=4_000_000), None)
    config = PackConfig(seq_len=1024, rows_per_shard=1024)
    pack = _best(rounds, lambda: _pack(paths, config), lambda: shutil.rmtree(paths.shards, ignore_errors=True))
    return {"num_bytes": written, **{f"ingest_{k}": v for k, v in ingest.items()},
            **{f"pack_{k}": v for k, v in pack.items()}}


def _best(rounds: int, measure: Callable[[], dict[str, float]], reset: Callable[[], None]) -> dict[str, float]:
    """The round with the least wall time (the run before each round undone, so every round does all the work)."""
    best: dict[str, float] | None = None
    for _ in range(rounds):
        reset()
        figures = measure()
        if best is None or figures["wall_s"] < best["wall_s"]:
            best = figures
    assert best is not None
    return best


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(work: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    cpu, started = _cpu_s(), time.perf_counter()
    result = work()
    wall = time.perf_counter() - started
    return result, {"wall_s": wall, "cores": (_cpu_s() - cpu) / wall}


def _ingest(manifest: Path, paths, dedupe) -> dict[str, float]:
    """Plan and ingest every part as the flow does (worker processes, one per core, near signatures made)."""
    from flows.runtime.stage_processes import run_stage_call, stage_processes
    from pipeline.ingest.stage import IngestPart, ingest_part, largest_first, plan_ingest

    def work() -> int:
        parts = largest_first(plan_ingest([manifest], paths, PART_SIZE_BYTES))
        workers = min(os.cpu_count() or 1, len(parts))
        with stage_processes(workers), ThreadPoolExecutor(workers) as threads:
            calls = [threads.submit(run_stage_call, ingest_part, IngestPart.from_dict(part.to_dict()),
                                    VAL_FRACTION, paths, near=dedupe.near) for part in parts]
            return len([call.result() for call in calls])

    num_parts, figures = _timed(work)
    return {**figures, "num_parts": num_parts}


def _forget_ingest(paths) -> None:
    shutil.rmtree(paths.root, ignore_errors=True)


def _pack(paths, config) -> dict[str, float]:
    """Pack (train, files/records) … as the flow does: every (split, source) pair on a pool of two threads."""
    from tokenization.stage import pack_split_source

    pairs = [(split, source) for split in SPLITS for source in ("files", "records")]

    def work() -> int:
        with ThreadPoolExecutor(2) as threads:
            calls = [threads.submit(pack_split_source, paths, split, source, config) for split, source in pairs]
            return sum(info.num_tokens for call in calls for info in call.result())

    num_tokens, figures = _timed(work)
    return {**figures, "num_tokens": num_tokens, "tokens_per_s": num_tokens / figures["wall_s"]}


def _report(results: dict[int, dict[str, float]]) -> None:
    print(f"{'size':<6}{'MB':>6}{'parts':>7}{'ingest s':>10}{'cores':>7}{'pack s':>8}{'cores':>7}"
          f"{'tokens':>12}{'tokens/s':>11}")
    for scale, row in results.items():
        print(f"{scale}x{'':<4}{row['num_bytes'] / 1e6:>6.0f}{row['ingest_num_parts']:>7.0f}"
              f"{row['ingest_wall_s']:>10.2f}{row['ingest_cores']:>7.2f}{row['pack_wall_s']:>8.2f}"
              f"{row['pack_cores']:>7.2f}{row['pack_num_tokens']:>12,.0f}{row['pack_tokens_per_s']:>11,.0f}")
    small, large = results[1], results[4]
    data_ratio = large["num_bytes"] / small["num_bytes"]
    print(f"4x/1x: data {data_ratio:.2f}x, ingest {large['ingest_wall_s'] / small['ingest_wall_s']:.2f}x, "
          f"pack {large['pack_wall_s'] / small['pack_wall_s']:.2f}x")
    print_result("tokenize_scale", large["pack_wall_s"], small["pack_wall_s"], "s pack wall (4x vs 1x data)")
