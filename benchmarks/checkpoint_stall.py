"""Benchmark: how long training waits for a checkpoint, synchronous vs ``train.async_checkpoint`` (125m preset, CPU).

One TrainingLoop (built-in model of the ``125m`` preset, AdamW, fp32) on random token rows, three runs of the same
steps: no checkpoints, a synchronous checkpoint every ``--every`` steps, an asynchronous one at the same steps.
Each run keeps training ``--every`` steps after its last save, and the async run's final wait for its background
write is timed too, so no write is left out of the figures. Two measures of the stall per save:

* ``blocked``: seconds the main thread spends inside ``Checkpointer.save`` (and the final wait). For a
  synchronous save that is the whole write, hashing and rename; for an async one, the CPU-memory copy of the
  state (plus any wait for the previous save).
* ``wall``: (run's wall time - the no-checkpoint run's) / saves. It also counts what the background write costs
  the training steps that run beside it (on a 2-core machine it competes for the cores), and machine noise.

The JSON line is ``blocked`` (ours = async, baseline = sync, milliseconds per save); the ``wall`` figures are printed
on the line before it. ``--quick`` uses the ``tiny`` preset.

    python -m benchmarks.checkpoint_stall --quick     # seconds
    python -m benchmarks.checkpoint_stall             # 125m: a few minutes and ~5 GB of RAM and disk
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.result import print_result
from core.rundir import RunPaths
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import MODEL_PRESETS, TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import ArrayRows, BatchLayout, TrainLoader
from trainer.loop import LoopCounters, TrainingLoop, seed_everything
from trainer.metrics.sink import MetricsSink
from trainer.model.llama import ModelShape, build_model
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel.accelerator import build_accelerator

MODES = ("none", "sync", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default=None, help="default 125m, quick tiny")
    parser.add_argument("--vocab-size", type=int, default=None, help="default 32000, quick 512")
    parser.add_argument("--seq-len", type=int, default=None, help="default 64, quick 32")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default 1, quick 2")
    parser.add_argument("--every", type=int, default=None, help="steps between saves (default 5, quick 2)")
    parser.add_argument("--saves", type=int, default=None, help="saves per run (default 2, quick 2)")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke test of the measurement")
    args = parser.parse_args(argv)
    defaults = {"preset": ("tiny", "125m"), "vocab_size": (512, 32000), "seq_len": (32, 64),
                "micro_batch_size": (2, 1), "every": (2, 5), "saves": (2, 2)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def build_loop(args: argparse.Namespace, scratch: Path) -> TrainingLoop:
    """A TrainingLoop as trainer.train composes it, on random rows; its checkpointer is replaced per mode."""
    train = TrainConfig(micro_batch_size=args.micro_batch_size, max_steps=100_000, warmup_steps=1)
    seed_everything(train.seed)
    accelerator = build_accelerator(train)
    model = build_model(ModelShape(MODEL_PRESETS[args.preset], args.vocab_size, args.seq_len), train.seed)
    optimizer = build_optimizer(model, train)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, train))
    tokens = np.random.default_rng(0).integers(2, args.vocab_size, size=(4096, args.seq_len), dtype=np.int64)
    loader = TrainLoader(ArrayRows(tokens), BatchLayout(train.micro_batch_size, 1), train.seed)
    paths = RunPaths(scratch)
    return TrainingLoop(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                        loader=loader, evaluator=Evaluator(None, train.micro_batch_size, 1, accelerator),
                        checkpointer=Checkpointer(accelerator, paths, 1, {}),
                        metrics=MetricsSink(paths, enabled=False), train=train, counters=LoopCounters())


def run_mode(loop: TrainingLoop, mode: str, args: argparse.Namespace, scratch: Path) -> tuple[float, float, float]:
    """(wall seconds of the run, seconds the main thread was blocked in saves and waits, of which waiting for a
    background write to finish)."""
    loop.checkpointer = Checkpointer(loop.accelerator, RunPaths(scratch / mode), 1, {"loop": loop.counters},
                                     async_save=mode == "async")
    blocked = waited = 0.0
    start = time.perf_counter()
    for step in range(1, (args.saves + 1) * args.every + 1):
        loop.train_step()
        if mode != "none" and step % args.every == 0 and step <= args.saves * args.every:
            wait_start = time.perf_counter()
            loop.checkpointer.wait_for_pending()  # inside save() too; timed apart: the previous write's tail
            save_start = time.perf_counter()
            loop.checkpointer.save(loop.counters.step)
            waited += save_start - wait_start
            blocked += time.perf_counter() - wait_start
    wait_start = time.perf_counter()
    loop.checkpointer.wait_for_pending()
    waited += time.perf_counter() - wait_start
    blocked += time.perf_counter() - wait_start
    return time.perf_counter() - start, blocked, waited


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch_name:
        scratch = Path(scratch_name)
        loop = build_loop(args, scratch)
        loop.train_step()  # warm-up: first-step allocations
        timings = {mode: run_mode(loop, mode, args, scratch) for mode in MODES}
        state_bytes = sum(p.stat().st_size for p in (scratch / "sync").rglob("*") if p.is_file())
    wall_stall = {mode: (timings[mode][0] - timings["none"][0]) / args.saves * 1000 for mode in ("sync", "async")}
    blocked = {mode: timings[mode][1] / args.saves * 1000 for mode in ("sync", "async")}
    steps = (args.saves + 1) * args.every
    print(json.dumps({"preset": args.preset, "checkpoint_bytes": state_bytes, "steps_per_run": steps,
                      "step_ms": round(timings["none"][0] / steps * 1000, 1),
                      "blocked_ms_per_save": {k: round(v, 1) for k, v in blocked.items()},
                      "wall_stall_ms_per_save": {k: round(v, 1) for k, v in wall_stall.items()},
                      "async_waited_for_write_ms_per_save": round(timings["async"][2] / args.saves * 1000, 1)}))
    return print_result("checkpoint_stall", blocked["async"], blocked["sync"], "ms blocked per save")


if __name__ == "__main__":
    main()
