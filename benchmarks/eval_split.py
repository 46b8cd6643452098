"""Benchmark: the full evaluation's whole-split scoring (Evaluator, bits per byte) vs a bare ``torch.no_grad()`` loop.

Both score the same rows with the same model and micro-batch size: the bare loop is what a user would write
(forward, summed cross-entropy, token count); tokenmill's adds per-source sums, the byte count of every scored
token (decoding each row with the run's tokenizer) and the cross-process gather. Rounds alternate between the two
so machine noise hits both alike; tokens/s comes from the median round. The last line printed is JSON.

    python -m benchmarks.eval_split --quick     # from the repo root; about a minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchmarks.result import print_result
from tokenization.byte_counts import ScoredBytes
from trainer.config import MODEL_PRESETS, TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import ArrayRows, make_batch
from trainer.model.llama import IGNORE_INDEX, ModelShape, build_model
from trainer.parallel.accelerator import build_accelerator

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=None, help="val rows scored per round (default 256, quick 96)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 5, quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 96 rows")
    args = parser.parse_args(argv)
    # --quick sets only what was not given, so a test can ask for a tinier run (tests/test_benchmarks.py)
    args.rounds = args.rounds or (3 if args.quick else 5)
    args.rows = args.rows or (96 if args.quick else 256)
    return args


def stdlib_rows(tokenizer_file: Path, vocab_size: int, seq_len: int, num_rows: int) -> np.ndarray:
    """Real text rows: standard-library source tokenised with a BPE trained on it, packed into ``seq_len``."""
    texts = [path.read_text(encoding="utf-8") for path in sorted((STDLIB / "json").rglob("*.py"))
             + sorted((STDLIB / "email").rglob("*.py"))]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.save(str(tokenizer_file))
    stream = np.concatenate([np.array([*tokenizer.encode(text).ids, 0], dtype=np.int64) for text in texts])
    stream = np.resize(stream, num_rows * seq_len)  # repeats when the text is shorter than asked
    return stream.reshape(num_rows, seq_len)


def bare_loop(model: torch.nn.Module, tokens: np.ndarray, micro_batch_size: int) -> float:
    """What a user would write: forward, summed cross-entropy over the shifted labels, token count."""
    loss_sum, num_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(tokens), micro_batch_size):
            batch = make_batch(tokens[start:start + micro_batch_size], 1)
            logits = model(batch.input_ids)
            labels = batch.labels[:, 1:]
            loss_sum += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                          labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                                          reduction="sum").item()
            num_tokens += int((labels != IGNORE_INDEX).sum())
    return loss_sum / num_tokens


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer_file = Path(folder) / "tokenizer.json"
        tokens = stdlib_rows(tokenizer_file, args.vocab_size, args.seq_len, args.rows)
        shape = ModelShape(MODEL_PRESETS[args.preset], args.vocab_size, args.seq_len)
        accelerator = build_accelerator(TrainConfig(micro_batch_size=args.micro_batch_size))
        model = build_model(shape, 0).to(accelerator.device).eval()
        evaluator = Evaluator(ArrayRows(tokens), args.micro_batch_size, None, accelerator,
                              byte_counter=ScoredBytes(tokenizer_file))
        times: dict[str, list[float]] = {"tokenmill": [], "bare": []}
        results: dict[str, float] = {}
        for _ in range(args.rounds):
            for name in times:
                start = time.perf_counter()
                if name == "tokenmill":
                    results[name] = evaluator.evaluate(model)["val_loss"]
                else:
                    results[name] = bare_loop(model, tokens, args.micro_batch_size)
                times[name].append(time.perf_counter() - start)
    num_tokens = tokens.size
    ours, baseline = (num_tokens / statistics.median(times[name]) for name in ("tokenmill", "bare"))
    print(f"whole-split scoring, {args.rows} rows x {args.seq_len} tokens, preset {args.preset}: "
          f"tokenmill {ours:,.0f} tokens/s (val_loss {results['tokenmill']:.5f}), bare no_grad loop "
          f"{baseline:,.0f} tokens/s (val_loss {results['bare']:.5f})")
    return print_result("eval_split", ours, baseline, "tokens/s")


if __name__ == "__main__":
    main()
