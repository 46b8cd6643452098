"""Benchmark of the tokenize + pack stage: tokenmill's encode+pack+write against raw ``Tokenizer.encode_batch``.

Same documents (the standard library's own ``.py`` files), same trained tokenizer, same Rust thread pool,
in one process. ``ours`` is :func:`tokenization.stage.pack_split_source` end to end: read the documents
parquet, encode, pack into rows, write Arrow shards. ``baseline`` is what a user would write by hand:
``encode_batch`` over batches of the texts already in memory, with no packing or writing at all.

``--scale`` measures how the stage grows instead: a corpus of perturbed stdlib copies
(:func:`benchmarks.ingest_memory.generate_corpus`) at 1x and 4x goes through the real ingest (parts in 2 worker
processes, as the flow runs them), dedupe and tokenizer stages, then the train and val packs run on 2 threads
at once (as the flow's thread pool runs them). It prints each stage's wall time and cores busy (CPU seconds of
the process and its finished children / wall seconds) and, last, the 4x / 1x pack wall-time ratio (4.0 is linear).

Run from the repo root: ``.venv/bin/python benchmarks/tokenize.py --quick``. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    _use_repo_imports()
    from benchmarks.corpus import stdlib_texts

    args = _parse_args(argv)
    if args.scale:
        from benchmarks.pack_scaling import run_scaling

        run_scaling(args.max_mb, args.rounds)
        return
    texts = stdlib_texts(args.max_mb * 1_000_000)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        results = run_benchmark(Path(tmp), texts, args.rounds, args.batch_docs)
    _print_report(results)


def _use_repo_imports() -> None:
    """Put the repo root on sys.path and take this file's folder off it.

    Run as a script, this folder is sys.path[0], and this file (named after the benchmark) would shadow
    the standard-library ``tokenize`` that pandas, linecache and inspect import.
    """
    here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 4 MB of text (well under 2 minutes)")
    parser.add_argument("--max-mb", type=int, default=None, help="MB of stdlib text to use (default 32, quick 4)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of each side; the best one counts")
    parser.add_argument("--scale", action="store_true",
                        help="ingest + pack at 1x and 4x of --max-mb (default 8): wall, cores busy, 4x/1x ratio")
    parser.add_argument("--batch-docs", type=int, default=256, help="documents per encode call, both sides")
    args = parser.parse_args(argv)
    args.max_mb = args.max_mb or (8 if args.scale else 4 if args.quick else 32)
    args.rounds = args.rounds or (3 if args.quick or args.scale else 2)
    return args


def run_benchmark(run_dir: Path, texts: list[str], rounds: int, batch_docs: int) -> dict:
    """Time both sides ``rounds`` times (interleaved, best round counts) and the packer alone."""
    from core.rundir import RunPaths
    from tokenization.config import PackConfig, TokenizerConfig
    from tokenization.train_tokenizer import load_tokenizer, prepare_tokenizer

    paths = RunPaths(run_dir)
    write_documents(run_dir, texts)
    started = time.perf_counter()
    prepare_tokenizer(paths, TokenizerConfig(vocab_size=8192, sample_bytes=4_000_000), None)
    train_s = time.perf_counter() - started
    tokenizer = load_tokenizer(paths.tokenizer)
    config = PackConfig(seq_len=1024, rows_per_shard=1024, encode_batch_docs=batch_docs)
    batches = [texts[i:i + batch_docs] for i in range(0, len(texts), batch_docs)]
    sides: dict[str, Callable[[], int]] = {
        "baseline": lambda: _count_ids(tokenizer.encode_batch, batches),
        "encode_batch_fast": lambda: _count_ids(tokenizer.encode_batch_fast, batches),
        "ours": lambda: _pack_once(paths, config),
    }
    best = _best_of(sides, rounds)
    return {"train_s": train_s, "texts": texts, "best": best, "pack": _packer_speed(tokenizer, texts, config)}


def write_documents(run_dir: Path, texts: list[str]) -> None:
    """The texts as finished documents parts (train split, one source), like the ingest stage writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from core.rundir import RunPaths
    from core.schemas import DOCUMENTS_SCHEMA

    docs = run_dir / "docs"
    docs.mkdir(parents=True)
    rows = [{"doc_id": i, "source": "stdlib", "source_id": None, "uri": f"doc{i}", "text": text,
             "num_chars": len(text), "content_hash": str(i), "split": "train"} for i, text in enumerate(texts)]
    for part, start in enumerate(range(0, len(rows), 2000)):
        table = pa.Table.from_pylist(rows[start:start + 2000], schema=DOCUMENTS_SCHEMA)
        pq.write_table(table, docs / f"part-{part:05d}.parquet")
        marker = RunPaths(run_dir).marker("ingest", f"part-{part:05d}")  # finished, as ingest marks it
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"format": 2, "fingerprint": str(part), "inputs": {}, "summary": {},
                                      "documents": str(part)}))


def _count_ids(encode_batch: Callable, batches: list[list[str]]) -> int:
    """Encode every batch the way a user would by hand; returns the number of ids."""
    return sum(len(encoding.ids) for batch in batches for encoding in encode_batch(batch, add_special_tokens=False))


def _pack_once(paths, config) -> int:
    """One full encode+pack+write of every document; returns document tokens (EOS excluded)."""
    from tokenization.stage import pack_split_source

    shutil.rmtree(paths.shards, ignore_errors=True)
    infos = pack_split_source(paths, "train", "stdlib", config)
    state = json.loads((paths.shards / "split=train/source=stdlib/state.json").read_text())
    return sum(info.num_tokens for info in infos) - state["num_documents"]


def _best_of(sides: dict[str, Callable[[], int]], rounds: int) -> dict[str, tuple[int, float]]:
    """{side: (tokens, fastest seconds)}; rounds interleave the sides so load drift hits all of them alike."""
    best: dict[str, tuple[int, float]] = {}
    for _ in range(rounds):
        for name, side in sides.items():
            started = time.perf_counter()
            num_tokens = side()
            seconds = time.perf_counter() - started
            if name not in best or seconds < best[name][1]:
                best[name] = (num_tokens, seconds)
    return best


def _packer_speed(tokenizer, texts: list[str], config) -> float:
    """Tokens/s of the Packer alone (add + take_rows + finish) on the encoded documents."""
    from core.shards.store import token_dtype_for_vocab
    from tokenization.encode import encode_texts
    from tokenization.pack import Packer

    encoded = encode_texts(tokenizer, texts)
    packer = Packer(config.seq_len, 0, 1, token_dtype_for_vocab(tokenizer.get_vocab_size()))
    started = time.perf_counter()
    for doc_id, tokens in enumerate(encoded):
        packer.add(doc_id, tokens)
        while packer.num_full_rows >= config.rows_per_shard:
            packer.take_rows(config.rows_per_shard)
    packer.finish()
    return sum(array.size + 1 for array in encoded) / (time.perf_counter() - started)


def _print_report(results: dict) -> None:
    texts, best = results["texts"], results["best"]
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    threads = os.environ.get("RAYON_NUM_THREADS") or f"{os.cpu_count()} (all cores)"
    print(f"documents: {len(texts)} stdlib .py files, {num_bytes / 1e6:.1f} MB; tokenizer vocab 8192 trained in "
          f"{results['train_s']:.1f} s; Rust threads: {threads}")
    print(f"{'side':<44}{'tokens':>12}{'seconds':>10}{'tokens/s':>14}")
    labels = {"baseline": "baseline: Tokenizer.encode_batch (in memory)",
              "encode_batch_fast": "raw Tokenizer.encode_batch_fast (in memory)",
              "ours": "tokenmill: parquet->encode->pack->shards"}
    for name, label in labels.items():
        num_tokens, seconds = best[name]
        print(f"{label:<44}{num_tokens:>12,}{seconds:>10.2f}{num_tokens / seconds:>14,.0f}")
    print(f"{'tokenmill Packer alone (no encode, no I/O)':<44}{'':>22}{results['pack']:>14,.0f}")
    ours, baseline = (best[name][0] / best[name][1] for name in ("ours", "baseline"))
    print(json.dumps({"name": "tokenize", "ours": round(ours), "baseline": round(baseline), "unit": "tokens/s",
                      "ratio": round(ours / baseline, 3)}))


if __name__ == "__main__":
    main()
