"""Read-only commands from a cold process: ``tokenmill --version``, ``query``, ``shards stats``, ``shards verify``.

Each command runs ``--repeats`` times, each in a new process (what a user typing it pays: interpreter start,
imports, reading the run dir). The baseline is what a data person would otherwise type: DuckDB from Python
answering the same question over the run's parquet files (``python -c "import duckdb; …"``).

    python -m benchmarks.cli_latency --run-dir runs/tiny     # the quick start's run
    python -m benchmarks.cli_latency --quick                 # a small run built here

The JSON line: ours = median seconds of ``tokenmill query``, baseline = median seconds of the DuckDB call.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.result import print_result

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
QUESTION = "SELECT source, split, count(*) AS documents FROM {table} GROUP BY ALL ORDER BY ALL"
"""The same question both ways: tokenmill over its ``documents`` view, DuckDB over the run's parquet parts."""
BASELINE = ("import sys, duckdb; "
            "print(duckdb.execute(sys.argv[1].replace('{table}', \"read_parquet(?)\"), [sys.argv[2]]).fetchall())")
"""The baseline program: the run's parquet glob is a bound parameter, never pasted into the SQL."""


def commands(run_dir: Path) -> dict[str, list[str]]:
    """The measured command lines by name (``duckdb`` is the baseline)."""
    run = str(run_dir)
    return {
        "tokenmill --version": [TOKENMILL, "--version"],
        "tokenmill query": [TOKENMILL, "query", run, QUESTION.format(table="documents")],
        "tokenmill shards stats": [TOKENMILL, "shards", "stats", run],
        "tokenmill shards verify": [TOKENMILL, "shards", "verify", run],
        "duckdb (python -c)": [sys.executable, "-c", BASELINE, QUESTION, str(run_dir / "docs" / "*.parquet")],
    }


def measure(argv: list[str], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` runs of ``argv``; a failed run stops the benchmark with its output."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        seconds.append(time.perf_counter() - started)
        if done.returncode != 0:
            raise SystemExit(f"{argv[:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def build_small_run(folder: Path, megabytes: float) -> Path:
    """Documents, a tokenizer and shards of a generated corpus, made by the stages in this process (no Prefect)."""
    from benchmarks.ingest_memory import generate_corpus
    from core.rundir import RunPaths
    from pipeline.config import DedupeConfig
    from pipeline.dedupe.stage import dedupe_documents
    from pipeline.ingest.stage import ingest_part, plan_ingest
    from pipeline.manifest import load_manifest
    from tokenization.config import PackConfig, TokenizerConfig
    from tokenization.stage import pack_split_source, write_index
    from tokenization.train_tokenizer import prepare_tokenizer

    manifest, _ = generate_corpus(folder / "corpus", int(megabytes * 1_000_000), shard_bytes=1 << 20)
    paths = RunPaths(folder / "run")
    for part in plan_ingest([manifest], paths, 1 << 20):
        ingest_part(part, 0.05, paths)
    dedupe_documents(paths, DedupeConfig())
    prepare_tokenizer(paths, TokenizerConfig(vocab_size=1024, sample_bytes=1_000_000), None)
    for split in ("train", "val"):
        for source in (source.name for source in load_manifest(manifest).sources):
            pack_split_source(paths, split, source, PackConfig(seq_len=256, rows_per_shard=512))
    write_index(paths)
    return paths.root


def report(run_dir: Path, repeats: int) -> None:
    timings = {name: measure(argv, repeats) for name, argv in commands(run_dir).items()}
    print(f"{'command':<26} {'first s':>8} {'median s':>9} {'max s':>7}   ({repeats} runs, each a new process)")
    for name, seconds in timings.items():
        print(f"{name:<26} {seconds[0]:>8.2f} {statistics.median(seconds):>9.2f} {max(seconds):>7.2f}")
    print_result("cli_latency_query", statistics.median(timings["tokenmill query"]),
                 statistics.median(timings["duckdb (python -c)"]), "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, help="A finished run dir (default: build a small one).")
    parser.add_argument("--repeats", type=int, help="Runs of each command (default 7; --quick 3).")
    parser.add_argument("--mb", type=float, help="Corpus size of the built run (default 8; --quick 1).")
    parser.add_argument("--quick", action="store_true", help="Fewer runs, a smaller built run.")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    if args.run_dir is not None:
        report(args.run_dir, repeats)
        return
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-cli-") as tmp:
        report(build_small_run(Path(tmp), args.mb or (1.0 if args.quick else 8.0)), repeats)


if __name__ == "__main__":
    main()
