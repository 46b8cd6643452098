"""Benchmark of peak memory: ingest + dedupe at 1x and 4x corpus size, each in a fresh subprocess.

The corpus is generated in a temporary folder from the standard library's ``.py`` files: half the bytes
as ``jsonl.gz`` shards of ~60-line chunks (many small records), half as plain text files (one document
per file). Every copy after the first drops a random 0-50% of its lines and gets its own header, so the
copies are a mix of near duplicates and distinct documents, not exact duplicates. Each size runs
``plan_ingest`` + ``ingest_part`` for every part + ``dedupe_documents`` (exact and near) in a new Python
process, which reports its peak RSS (``ru_maxrss``) after ingest and after dedupe.

Bounded memory means the 4x peak is close to the 1x peak: only the dedupe catalog (ids, uris, content
hashes: ~0.15 KB per document) grows with the corpus. ``--one-file`` writes the jsonl half as one file
instead of 32 MB shards: a file bigger than a part is a part of its own, so the largest part grows with
the corpus too (what a part holds in memory, e.g. its MinHash signatures, must not).

``--bombs`` measures hostile input instead: a 32 KB zstd file and a gzip file that each expand to one line
of 256 MiB, then of 1 GiB (each with a valid record after it). A line longer than
``pipeline.ingest.streams.record_byte_limit(filters.max_chars)`` (87 MiB at the default max_chars) is rejected as
``too_long`` while it streams, so the peak stays within the same bound at both sizes (ratio ~1.0): imports +
one record at that limit + a few 1 MiB chunks (measured: 277 MB at both sizes). Before that bound the
same files took 3.3 GB (256 MiB) and 12.5 GB (1 GiB) of RSS.

Run from the repo root: ``.venv/bin/python -m benchmarks.ingest_memory --quick``. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.corpus import stdlib_texts

CHUNK_LINES = 60
SHARD_BYTES = 32 << 20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1x = 40 MB (about a minute)")
    parser.add_argument("--mb", type=int, default=None, help="MB of text at 1x (default 200, quick 40)")
    parser.add_argument("--one-file", action="store_true", help="the jsonl half as one file, not 32 MB shards")
    parser.add_argument("--bombs", action="store_true", help="decompression bombs of 256 MiB and 1 GiB instead")
    parser.add_argument("--child", nargs=2, metavar=("MANIFEST", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(ingest_and_dedupe(Path(args.child[0]), Path(args.child[1]))))
        return
    if args.bombs:
        report_bombs({size: measure_bombs(size) for size in BOMB_SIZES})
        return
    base_mb = args.mb or (40 if args.quick else 200)
    shard_bytes = 1 << 62 if args.one_file else SHARD_BYTES
    results = {scale: measure(base_mb * scale * 1_000_000, shard_bytes) for scale in (1, 4)}
    report(results, "ingest_memory_one_file" if args.one_file else "ingest_memory")


def measure(num_bytes: int, shard_bytes: int = SHARD_BYTES) -> dict:
    """Generate a corpus of ``num_bytes`` and run ingest + dedupe over it in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-memory-") as tmp:
        started = time.perf_counter()
        manifest, written = generate_corpus(Path(tmp), num_bytes, shard_bytes=shard_bytes)
        generate_s = time.perf_counter() - started
        command = [sys.executable, "-m", "benchmarks.ingest_memory", "--child", str(manifest), f"{tmp}/run"]
        child = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[1])
        if child.returncode != 0:
            raise SystemExit(f"the measured process failed:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
    return {**result, "num_bytes": written, "generate_s": generate_s}


def generate_corpus(folder: Path, num_bytes: int, seed: int = 0,
                    shard_bytes: int = SHARD_BYTES) -> tuple[Path, int]:
    """jsonl.gz shards (of ``shard_bytes`` of text) of chunks + text files, ``num_bytes`` of UTF-8 in all;
    returns (manifest, bytes)."""
    import yaml

    rng = np.random.default_rng(seed)
    base = stdlib_texts(10**9)
    (folder / "jsonl").mkdir(parents=True)
    written = in_shard = 0
    shard = None
    replica = 0
    while written < num_bytes:
        for number, text in enumerate(base):
            if replica:
                text = perturb(text, rng, f"{replica}-{number}")
            data = text.encode("utf-8")
            if number % 2:  # odd files: one text document each
                path = folder / "text" / f"r{replica:03d}" / f"{number:05d}.py"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            else:  # even files: ~60-line chunks as jsonl records
                if shard is None or in_shard >= shard_bytes:
                    shard = _next_shard(folder, shard)
                    in_shard = 0
                for index, chunk in enumerate(chunk_lines(text)):
                    shard.write(json.dumps({"id": f"{replica}-{number}-{index}", "text": chunk}).encode() + b"\n")
                in_shard += len(data)
            written += len(data)
            if written >= num_bytes:
                break
        replica += 1
    shard.close()
    manifest = folder / "corpus.yaml"
    manifest.write_text(yaml.safe_dump({"name": "memory", "sources": [
        {"name": "records", "path": "jsonl", "format": "jsonl", "glob": "*.jsonl.gz", "id_field": "id"},
        {"name": "files", "path": "text", "format": "text", "glob": "**/*.py"}]}), encoding="utf-8")
    return manifest, written


def _next_shard(folder: Path, shard):
    if shard is not None:
        shard.close()
    number = len(list((folder / "jsonl").glob("*.jsonl.gz")))
    return gzip.open(folder / "jsonl" / f"shard-{number:04d}.jsonl.gz", "wb", compresslevel=1)


def perturb(text: str, rng: np.random.Generator, label: str) -> str:
    """Drop a random 0-50% of the lines and put a header line on top."""
    lines = text.split("\n")
    keep = rng.random(len(lines)) >= rng.uniform(0.0, 0.5)
    return f"# copy {label}\n" + "\n".join([line for line, kept in zip(lines, keep, strict=True) if kept])


def chunk_lines(text: str) -> list[str]:
    lines = text.split("\n")
    return ["\n".join(lines[start : start + CHUNK_LINES]) for start in range(0, len(lines), CHUNK_LINES)]


def ingest_and_dedupe(manifest: Path, run_dir: Path) -> dict:
    """In the measured process: every stage on the corpus, with the peak RSS after each."""
    from core.rundir import RunPaths
    from pipeline.config import DedupeConfig
    from pipeline.dedupe.stage import dedupe_documents
    from pipeline.ingest.stage import ingest_part, plan_ingest

    paths = RunPaths(run_dir)
    imports_mb = _peak_rss_mb()
    started = time.perf_counter()
    config = DedupeConfig()
    summaries = [ingest_part(part, 0.05, paths, near=config.near)  # as the flow does: signatures made at ingest
                 for part in plan_ingest([manifest], paths, 32 << 20)]
    ingest_s, ingest_mb = time.perf_counter() - started, _peak_rss_mb()
    started = time.perf_counter()
    dedupe = dedupe_documents(paths, config)
    return {"imports_mb": imports_mb, "ingest_mb": ingest_mb, "peak_mb": _peak_rss_mb(), "ingest_s": ingest_s,
            "dedupe_s": time.perf_counter() - started, "num_parts": len(summaries),
            "num_documents": sum(s["num_documents"] for s in summaries), **dedupe}


BOMB_SIZES = (256 << 20, 1 << 30)
"""Bytes each bomb's single line expands to."""


def measure_bombs(num_bytes: int) -> dict:
    """Ingest (+ dedupe) a zstd and a gzip bomb of one ``num_bytes`` line each, in a fresh process."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-bombs-") as tmp:
        folder = Path(tmp) / "bombs"
        compressed = write_bombs(folder, num_bytes)
        manifest = Path(tmp) / "corpus.yaml"
        manifest.write_text(yaml.safe_dump({"name": "bombs", "sources": [
            {"name": "bombs", "path": "bombs", "format": "jsonl", "on_error": "skip"}]}), encoding="utf-8")
        command = [sys.executable, "-m", "benchmarks.ingest_memory", "--child", str(manifest), f"{tmp}/run"]
        child = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).parents[1])
        if child.returncode != 0:
            raise SystemExit(f"the measured process failed:\n{child.stderr[-3000:]}")
        return {**json.loads(child.stdout.strip().splitlines()[-1]), "compressed_bytes": compressed}


def write_bombs(folder: Path, num_bytes: int) -> dict[str, int]:
    """``bomb.jsonl.zst`` and ``bomb.jsonl.gz``: one line of ``num_bytes`` repeats, then one valid record; returns
    ``{file name: compressed bytes}``."""
    import zstandard

    folder.mkdir(parents=True)
    block = b"A" * (1 << 20)
    valid = json.dumps({"text": "A valid record after the bomb, with enough words in it."}).encode() + b"\n"
    with open(folder / "bomb.jsonl.zst", "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as out:
        out.write(b'{"text": "')
        for _ in range(num_bytes >> 20):
            out.write(block)
        out.write(b'"}\n' + valid)
    with gzip.open(folder / "bomb.jsonl.gz", "wb", compresslevel=1) as out:
        for _ in range(num_bytes >> 20):
            out.write(block)
        out.write(b"\n" + valid)
    return {path.name: path.stat().st_size for path in sorted(folder.iterdir())}


def report_bombs(results: dict[int, dict]) -> None:
    from pipeline.ingest.readers import DEFAULT_MAX_CHARS
    from pipeline.ingest.streams import record_byte_limit

    print(f"record limit: {record_byte_limit(DEFAULT_MAX_CHARS) >> 20} MiB (default filters.max_chars)")
    print(f"{'line':<9}{'zstd file':>11}{'gzip file':>11}{'docs':>6}{'RSS imports':>13}{'after ingest':>14}")
    for size, row in results.items():
        sizes = row["compressed_bytes"]
        print(f"{size >> 20:>5} MiB{sizes['bomb.jsonl.zst']:>10}B{sizes['bomb.jsonl.gz']:>10}B"
              f"{row['num_documents']:>6}{row['imports_mb']:>12.0f}M{row['ingest_mb']:>13.0f}M")
    small, large = (results[size]["ingest_mb"] for size in BOMB_SIZES)
    print(json.dumps({"name": "ingest_memory_bombs", "ours": round(large, 1), "baseline": round(small, 1),
                      "unit": "MB peak RSS (1 GiB vs 256 MiB line)", "ratio": round(large / small, 3)}))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def report(results: dict[int, dict], name: str = "ingest_memory") -> None:
    print(f"{'size':<6}{'MB text':>9}{'docs':>10}{'parts':>7}{'ingest s':>10}{'dedupe s':>10}{'near dups':>11}"
          f"{'RSS imports':>13}{'after ingest':>14}{'peak (dedupe)':>15}")
    for scale, row in results.items():
        print(f"{scale}x{'':<4}{row['num_bytes'] / 1e6:>9.0f}{row['num_documents']:>10}{row['num_parts']:>7}"
              f"{row['ingest_s']:>10.1f}{row['dedupe_s']:>10.1f}{row['num_near_duplicates']:>11}"
              f"{row['imports_mb']:>12.0f}M{row['ingest_mb']:>13.0f}M{row['peak_mb']:>14.0f}M")
    small, large = results[1]["peak_mb"], results[4]["peak_mb"]
    print(json.dumps({"name": name, "ours": round(large, 1), "baseline": round(small, 1),
                      "unit": "MB peak RSS", "ratio": round(large / small, 3)}))


if __name__ == "__main__":
    main()
