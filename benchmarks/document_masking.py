"""Benchmark: ``train.document_masking`` on vs off — training tokens/s, and val loss after training either way.

Throughput: the same TrainingLoop step (built-in model, AdamW, clipping) on the same real rows (standard-library
files, tokenised with a BPE trained on them and packed into rows as the pack stage does, so ``doc_starts`` are
real), with and without the document mask; rounds alternate so machine noise hits both alike. Reported per
wall second (median step) and per CPU second (the process's CPU time, median step): on a shared machine other
processes' load swings wall time by 2-5x, CPU time far less, so the JSON line (ours = masked, baseline =
unmasked) is tokens per CPU second.

Val loss: the full run trains the ``tiny`` recipe (configs/tiny.yaml: prepared once, then trained twice by
``python -m trainer.train``, the same data order and seed) and scores each exported model on the whole val split
both masked and unmasked, so a masked model is also compared where packed context is allowed. ``--quick`` trains
a few steps on the in-memory rows instead (a smoke test, not the recipe). The last line printed is JSON.

    python -m benchmarks.document_masking --quick                 # seconds
    python -m benchmarks.document_masking                         # prepares and trains configs/tiny.yaml twice
    python -m benchmarks.document_masking --run-dir runs/tiny     # reuse a prepared run dir (copied, not changed)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.corpus import stdlib_texts
from benchmarks.result import print_result
from core.rundir import RunPaths
from tokenization.pack import Packer
from tokenization.special_tokens import read_special_tokens
from tokenization.train_tokenizer import train_tokenizer
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import MODEL_PRESETS, TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import EOS_ID, PAD_ID, ArrayRows, BatchLayout, SplitRows, TokenRows, TrainLoader
from trainer.loop import LoopCounters, TrainingLoop, seed_everything
from trainer.metrics.sink import MetricsSink
from trainer.model.llama import ModelShape, build_model
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel.accelerator import build_accelerator

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"unmasked": False, "document_masking": True}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=None, help="default 256 (the tiny recipe's), quick 64")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 16, quick 4")
    parser.add_argument("--vocab-size", type=int, default=None, help="default 4096, quick 512")
    parser.add_argument("--corpus-mb", type=float, default=None, help="stdlib text to pack (default 4, quick 0.1)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 5, quick 2)")
    parser.add_argument("--steps-per-round", type=int, default=None, help="default 4, quick 1")
    parser.add_argument("--recipe", type=Path, default=REPO_ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--run-dir", type=Path, default=None, help="a prepared run dir of the recipe to copy")
    parser.add_argument("--quick", action="store_true", help="tiny sizes; val loss after a few in-memory steps")
    parser.add_argument("--no-val-loss", action="store_true", help="measure throughput only")
    args = parser.parse_args(argv)
    # --quick sets only what was not given, so a test can ask for a tinier run (tests/test_benchmarks.py)
    defaults = {"seq_len": (64, 256), "micro_batch_size": (4, 16), "vocab_size": (512, 4096),
                "corpus_mb": (0.1, 4.0), "rounds": (2, 5), "steps_per_round": (1, 4)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def packed_stdlib_rows(max_mb: float, vocab_size: int, seq_len: int) -> ArrayRows:
    """Standard-library files as documents, BPE-tokenised and packed into rows with their real ``doc_starts``."""
    texts = stdlib_texts(int(max_mb * 1e6))
    tokenizer = train_tokenizer(texts, vocab_size)
    packer = Packer(seq_len, EOS_ID, PAD_ID, np.dtype(np.uint16))
    for doc_id, encoding in enumerate(tokenizer.encode_batch_fast(texts, add_special_tokens=False)):
        packer.add(doc_id, np.array(encoding.ids, dtype=np.uint16))
    rows = packer.finish()
    return ArrayRows(rows.input_ids, doc_starts=[np.array(starts) for starts in rows.doc_starts])


def build_loop(rows: ArrayRows, train: TrainConfig, vocab_size: int, scratch: Path, masking: bool) -> TrainingLoop:
    """A TrainingLoop as trainer.train composes it (built-in tiny model), with or without the mask; writes nothing."""
    accelerator = build_accelerator(train)
    model = build_model(ModelShape(MODEL_PRESETS["tiny"], vocab_size, rows.seq_len), train.seed)
    optimizer = build_optimizer(model, train)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, train))
    loader = TrainLoader(rows, BatchLayout(train.micro_batch_size, 1), train.seed, document_masking=masking)
    paths = RunPaths(scratch)
    return TrainingLoop(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                        loader=loader, evaluator=Evaluator(None, train.micro_batch_size, 1, accelerator),
                        checkpointer=Checkpointer(accelerator, paths, 1, {}),
                        metrics=MetricsSink(paths, enabled=False), train=train, counters=LoopCounters())


def tokens_per_s(rows: ArrayRows, args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """(variant, "wall" | "cpu") -> tokens per second of the median step; one untimed warm-up step each, then
    alternating rounds."""
    train = TrainConfig(micro_batch_size=args.micro_batch_size, max_steps=1000)
    seed_everything(train.seed)
    times: dict[tuple[str, str], list[float]] = {(name, clock): [] for name in VARIANTS for clock in CLOCKS}
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        loops = {name: build_loop(rows, train, args.vocab_size, Path(scratch), masking)
                 for name, masking in VARIANTS.items()}
        for loop in loops.values():
            loop.train_step()
        for _ in range(args.rounds):
            for name, loop in loops.items():
                for _ in range(args.steps_per_round):
                    starts = {clock: read() for clock, read in CLOCKS.items()}
                    loop.train_step()
                    for clock, read in CLOCKS.items():
                        times[(name, clock)].append(read() - starts[clock])
    return {key: args.micro_batch_size * rows.seq_len / statistics.median(values) for key, values in times.items()}


def scored_both_ways(model: torch.nn.Module, val_rows: TokenRows, micro_batch_size: int) -> dict[str, float]:
    """{scored: val loss} of ``model`` on every row of ``val_rows``, scored unmasked and masked."""
    accelerator = build_accelerator(TrainConfig())
    return {scored: Evaluator(val_rows, micro_batch_size, None, accelerator,
                              document_masking=masking).evaluate(model)["val_loss"]
            for scored, masking in VARIANTS.items()}


def quick_val_losses(rows: ArrayRows, vocab_size: int) -> dict[tuple[str, str], float]:
    """(trained, scored) -> val loss after 4 steps on the first rows, scored on the last 16 (a smoke test)."""
    num_val = 16
    split = rows.num_rows - num_val
    train_rows = ArrayRows(rows.tokens[:split], doc_starts=rows.doc_starts(np.arange(split)))
    val_rows = ArrayRows(rows.tokens[split:], doc_starts=rows.doc_starts(np.arange(split, rows.num_rows)))
    train = TrainConfig(micro_batch_size=4, max_steps=4, warmup_steps=1)
    losses = {}
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        for trained, masking in VARIANTS.items():
            seed_everything(train.seed)
            loop = build_loop(train_rows, train, vocab_size, Path(scratch), masking)
            for _ in range(train.max_steps):
                loop.train_step()
            for scored, loss in scored_both_ways(loop.model, val_rows, 4).items():
                losses[(trained, scored)] = loss
    return losses


RUN_OUTPUTS = ("checkpoints", "metrics", "model", "eval", "report")
"""What training writes into a run dir: left out when a prepared run dir is copied for each variant."""


def recipe_val_losses(recipe: Path, prepared: Path | None, scratch: Path) -> dict[tuple[str, str], float]:
    """(trained, scored) -> whole-val-split loss of the recipe's model trained with and without the mask.

    The recipe is prepared once (unless ``prepared`` is given); each variant trains on a copy of it, with
    ``train.document_masking`` set in its run.yaml, by ``python -m trainer.train`` as ``tokenmill train`` runs it.
    The two trainings run at the same time (the losses do not depend on timing; it halves the wait).
    """
    from transformers import AutoModelForCausalLM

    if prepared is None:
        prepared = scratch / "prepared"
        tokenmill = Path(sys.executable).with_name("tokenmill")  # the CLI installed beside this interpreter
        subprocess.run([str(tokenmill), "prepare", str(recipe), "--run-dir", str(prepared)], cwd=REPO_ROOT,
                       check=True)
    trainings = {}
    for trained, masking in VARIANTS.items():
        run_dir = scratch / trained
        shutil.copytree(prepared, run_dir, ignore=shutil.ignore_patterns(*RUN_OUTPUTS))
        recipe_data = yaml.safe_load((run_dir / "run.yaml").read_text(encoding="utf-8"))
        recipe_data["train"] = {**(recipe_data.get("train") or {}), "document_masking": masking}
        (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe_data, sort_keys=False), encoding="utf-8")
        with open(run_dir / "train.log", "wb") as log:
            trainings[trained] = subprocess.Popen([sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)],
                                                  cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    losses = {}
    for trained, training in trainings.items():
        run_dir = scratch / trained
        if training.wait() != 0:
            raise SystemExit(f"training {trained} failed:\n{(run_dir / 'train.log').read_text()[-2000:]}")
        log_lines = (run_dir / "train.log").read_text().splitlines()
        evaluations = [line for line in log_lines if line.startswith("eval step")]
        print(f"{trained}: {evaluations[-1]} (in-loop subset)", flush=True)
        model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32)
        special = read_special_tokens(RunPaths(run_dir))
        val_rows = SplitRows(run_dir, "val", special.pad_id, pad_is_eos=special.pad_is_eos)
        for scored, loss in scored_both_ways(model, val_rows, 16).items():
            losses[(trained, scored)] = loss
    return losses


def mean_documents_per_row(rows: ArrayRows) -> float:
    return float(np.mean([len(starts) for starts in rows.doc_starts(np.arange(rows.num_rows))]))


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    if args.no_val_loss:
        losses, what = {}, "not measured (--no-val-loss)"
    elif args.quick:
        losses, what = quick_val_losses(packed_stdlib_rows(0.1, 512, 64), 512), "after 4 in-memory steps (--quick)"
    else:  # trained first: the throughput rounds then run without the two trainings beside them
        with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
            losses = recipe_val_losses(args.recipe, args.run_dir, Path(scratch))
        what = f"after {args.recipe.name}, whole val split"
    rows = packed_stdlib_rows(args.corpus_mb, args.vocab_size, args.seq_len)
    rate = tokens_per_s(rows, args)
    print(f"tiny preset, seq_len={args.seq_len}, micro_batch={args.micro_batch_size}, {rows.num_rows} rows of "
          f"stdlib files ({mean_documents_per_row(rows):.2f} documents per row), threads={torch.get_num_threads()}, "
          f"steps/variant={args.rounds * args.steps_per_round}")
    for name in VARIANTS:
        print(f"{name:18} {rate[(name, 'wall')]:10,.0f} tokens/s  {rate[(name, 'cpu')]:10,.0f} tokens/CPU-s")
    print(f"val loss {what}:")
    for (trained, scored), loss in losses.items():
        print(f"  trained {trained:17} scored {scored:17} {loss:.4f}")
    return print_result("document_masking", rate[("document_masking", "cpu")], rate[("unmasked", "cpu")],
                        "tokens/CPU-s")


if __name__ == "__main__":
    main()
