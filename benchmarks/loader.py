"""Benchmark: tokenmill's training loader (memory-mapped Arrow shards -> int64 batches) vs ``np.memmap`` windows.

Same tokens on both sides. ``ours`` is :class:`trainer.loader.batches.TrainLoader` over
:class:`trainer.loader.batches.SplitRows` exactly as ``trainer.train`` builds it: zero-copy memory-mapped Arrow IPC
shards, a shuffled global order, rows gathered into an int64 ``input_ids`` tensor plus ``labels`` (padding masked).
``baseline`` is the loader users write by hand over the same tokens as one flat uint16 ``.bin`` and ``np.memmap``:
random windows of ``seq_len + 1`` tokens in one vectorised gather, cast to int64, split into ``x`` and shifted
``y``. nanoGPT's ``get_batch`` (a Python loop of slices, ``astype`` and ``torch.stack``) is timed too,
for reference. Each side produces two [batch, seq_len] int64 tensors per batch; rounds alternate so
machine noise hits all sides alike, and the median round counts. The run also measures how many
tokens/s the ``tiny`` preset trains on this CPU, to say how far ahead of the training step the loader is.

    python -m benchmarks.loader --quick     # from the repo root; < 2 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.result import print_result
from benchmarks.train_step import bare_pytorch_step, token_rows
from core.files.atomic import sha256_file
from core.shards.store import ShardRows, shard_relpath, write_shard, write_shard_index
from trainer.config import MODEL_PRESETS, TrainConfig
from trainer.loader.batches import PAD_ID, BatchLayout, SplitRows, TrainLoader
from trainer.model.llama import ModelShape

VOCAB_SIZE = 4096
OURS = "tokenmill TrainLoader (Arrow mmap)"
BASELINE = "np.memmap random windows (vectorised)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="rows of seq_len tokens, both sides (default 32768)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rows-per-shard", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=None, help="alternating timed rounds per side (default 7)")
    parser.add_argument("--batches-per-round", type=int, default=None, help="default 200")
    parser.add_argument("--quick", action="store_true", help="8192 rows, 5 rounds of 100 batches (< 2 minutes)")
    args = parser.parse_args(argv)
    # --quick sets only what was not given, so a test can ask for a tinier run (tests/test_benchmarks.py)
    quick = {"rows": 8192, "rounds": 5, "batches_per_round": 100} if args.quick else {}
    full = {"rows": 32768, "rounds": 7, "batches_per_round": 200}
    for name, value in full.items():
        if getattr(args, name) is None:
            setattr(args, name, quick.get(name, value))
    return args


def write_run_shards(run_dir: Path, tokens: np.ndarray, rows_per_shard: int) -> None:
    """The tokens as train shards + index, the way the pack stage writes them (one source)."""
    tokenizer = run_dir / "tokenizer" / "tokenizer.json"
    tokenizer.parent.mkdir(parents=True)
    tokenizer.write_text("{}", encoding="utf-8")
    infos = []
    for part, lo in enumerate(range(0, len(tokens), rows_per_shard)):
        chunk = tokens[lo:lo + rows_per_shard]
        rows = ShardRows(chunk, [[lo + i] for i in range(len(chunk))], [[0]] * len(chunk), [0] * len(chunk),
                         [chunk.shape[1]] * len(chunk))
        infos.append(write_shard(run_dir, shard_relpath("train", "bench", part), rows, split="train",
                                 source="bench", tokenizer_sha256=sha256_file(tokenizer), vocab_size=VOCAB_SIZE))
    write_shard_index(run_dir, infos)


def tokenmill_batches(run_dir: Path, batch_size: int) -> Batches:
    """TrainLoader.next_step exactly as the trainer calls it (one micro-batch per step)."""
    loader = TrainLoader(SplitRows(run_dir, "train", PAD_ID), BatchLayout(batch_size, 1), seed=0)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        batch = loader.next_step()[0]
        return batch.input_ids, batch.labels

    return next_batch


Batches = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def memmap_batches(bin_path: Path, seq_len: int, batch_size: int) -> Batches:
    """Random windows of a flat uint16 memmap in one fancy-index gather; int64 x and shifted y."""
    data = np.memmap(bin_path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    offsets = np.arange(seq_len + 1)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        windows = torch.from_numpy(data[starts[:, None] + offsets].astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    return next_batch


def nanogpt_batches(bin_path: Path, seq_len: int, batch_size: int) -> Batches:
    """nanoGPT's get_batch: a Python loop of memmap slices, stacked as int64 x and shifted y."""
    data = np.memmap(bin_path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        x = torch.stack([torch.from_numpy(data[i:i + seq_len].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq_len].astype(np.int64)) for i in starts])
        return x, y

    return next_batch


def time_rounds(sides: dict[str, Callable[[], object]], rounds: int, batches: int) -> dict[str, list[float]]:
    """Batches/s of each side per round; rounds alternate; one untimed warm-up round (page cache) first."""
    for next_batch in sides.values():
        for _ in range(batches):
            next_batch()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, next_batch in sides.items():
            start = time.perf_counter()
            for _ in range(batches):
                next_batch()
            rates[name].append(batches / (time.perf_counter() - start))
    return rates


def training_tokens_per_s(num_steps: int = 4) -> float:
    """Tokens/s the ``tiny`` preset trains at on this CPU (fp32, tiny recipe's seq 256 x batch 16)."""
    train = TrainConfig(micro_batch_size=16, max_steps=1000)
    shape = ModelShape(MODEL_PRESETS["tiny"], VOCAB_SIZE, 256)
    step = bare_pytorch_step(shape, train, token_rows(VOCAB_SIZE, 256), torch.device("cpu"))
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return num_steps * 16 * 256 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    tokens = token_rows(VOCAB_SIZE, args.seq_len, args.rows)
    with tempfile.TemporaryDirectory(prefix="tm-bench-loader-") as scratch:
        run_dir = Path(scratch)
        write_run_shards(run_dir, tokens, args.rows_per_shard)
        tokens.tofile(run_dir / "tokens.bin")
        bin_path = run_dir / "tokens.bin"
        sides = {BASELINE: memmap_batches(bin_path, args.seq_len, args.batch_size),
                 OURS: tokenmill_batches(run_dir, args.batch_size),
                 "nanoGPT get_batch (memmap, Python loop)": nanogpt_batches(bin_path, args.seq_len, args.batch_size)}
        rates = time_rounds(sides, args.rounds, args.batches_per_round)
    median = {name: statistics.median(values) for name, values in rates.items()}
    tokens_per_batch = args.batch_size * args.seq_len
    training_rate = training_tokens_per_s()
    print(f"rows={args.rows} seq_len={args.seq_len} batch={args.batch_size} threads={torch.get_num_threads()} "
          f"rounds={args.rounds}x{args.batches_per_round} batches")
    print(f"{'loader':40} {'batches/s':>10} {'M tokens/s':>11}")
    for name, rate in median.items():
        print(f"{name:40} {rate:10,.0f} {rate * tokens_per_batch / 1e6:11.1f}")
    ours, baseline = median[OURS], median[BASELINE]
    headroom = ours * tokens_per_batch / training_rate
    print(f"tiny preset trains {training_rate:,.0f} tokens/s on this CPU: the loader delivers {headroom:,.0f}x that")
    return print_result("loader", ours, baseline, "batches/s")


if __name__ == "__main__":
    main()
