"""Benchmark: tokenmill's training step (TrainingLoop on Accelerate) vs a bare PyTorch loop, same model and batch.

Both variants build the same model from the same seed, use the same AdamW groups, LR schedule,
gradient clipping and precision, and draw the same kind of micro-batches from one token array; only
the step machinery differs (Accelerate's prepare/accumulate/backward/clip and our loader vs plain
``loss.backward(); opt.step()``). A third variant runs the same TrainingLoop on Hugging Face's
``LlamaForCausalLM`` of the same dims (what ``model.hf_config`` trains), so the built-in model's speed is
measured against transformers' own. Rounds alternate between the variants so machine noise hits all alike;
tokens/s comes from the median step time. The last line printed is JSON for the results table.

Both run where the trainer would: on the GPU when CUDA is available (``build_accelerator`` decides),
else on the CPU; MFU divides by that device's peak (``trainer.metrics.telemetry.device_peak``: the data sheet
of a known GPU, else a matmul probe).

    python -m benchmarks.train_step --quick     # from the repo root; < 2 minutes on a 2-core CPU
    python -m benchmarks.train_step --preset 125m --seq-len 1024 --precision bf16 --vocab-size 32000  # GPU
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
from accelerate import Accelerator
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from benchmarks.result import print_result
from core.rundir import RunPaths
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.config import MODEL_PRESETS, TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import PAD_ID, ArrayRows, BatchLayout, TrainLoader, make_batch
from trainer.loop import LoopCounters, TrainingLoop, seed_everything
from trainer.metrics.sink import MetricsSink
from trainer.metrics.telemetry import device_peak
from trainer.model.export import hf_llama_config
from trainer.model.llama import ModelShape, build_model, flops_per_token
from trainer.model.spec import BuiltinSpec, HuggingFaceSpec, ModelSpec
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel.accelerator import apply_model_options, build_accelerator

HF_VARIANT = "tokenmill TrainingLoop, HF LlamaForCausalLM"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per variant (default 6, quick 3)")
    parser.add_argument("--steps-per-round", type=int, default=None, help="default 5, quick 3")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 3 steps (under 2 minutes on 2 cores)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder block in both variants")
    return parser.parse_args(argv)


def token_rows(vocab_size: int, seq_len: int, num_rows: int = 512) -> np.ndarray:
    """Zipf-like token ids (frequent low ids, as a BPE produces), uint16 like a shard."""
    ranks = np.random.default_rng(0).zipf(1.2, size=(num_rows, seq_len))
    return (ranks % (vocab_size - 2) + 2).astype(np.uint16)


def bare_pytorch_step(shape: ModelShape, train: TrainConfig, tokens: np.ndarray,
                      device: torch.device) -> Callable[[], None]:
    """The loop a user would write by hand on ``device``: forward, backward, clip, AdamW step, schedule step."""
    model = apply_model_options(build_model(shape, train.seed), train, BuiltinSpec(shape)).to(device)
    optimizer = build_optimizer(model, train)
    scheduler = build_lr_scheduler(optimizer, train)
    order = np.random.default_rng(train.seed).permutation(len(tokens))
    position = [0]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.precision == "bf16")

    def step() -> None:
        rows = order[np.arange(position[0], position[0] + train.micro_batch_size) % len(order)]
        position[0] += train.micro_batch_size
        batch = make_batch(tokens[rows], PAD_ID)
        with autocast:
            loss = model(batch.input_ids.to(device), batch.labels.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def tokenmill_step(spec: ModelSpec, train: TrainConfig, tokens: np.ndarray, scratch: Path,
                   accelerator: Accelerator) -> Callable[[], None]:
    """TrainingLoop.train_step exactly as trainer.train runs it (checkpoints/eval/metrics are not timed)."""
    model = apply_model_options(spec.build(train.seed), train, spec)
    optimizer = build_optimizer(model, train)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, train))
    loader = TrainLoader(ArrayRows(tokens), BatchLayout(train.micro_batch_size, 1), train.seed)
    paths = RunPaths(scratch)  # a scratch run dir: nothing is written there while timing
    loop = TrainingLoop(accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                        loader=loader, evaluator=Evaluator(None, train.micro_batch_size, 1, accelerator),
                        checkpointer=Checkpointer(accelerator, paths, 1, {}),
                        metrics=MetricsSink(paths, enabled=False), train=train, counters=LoopCounters())
    return lambda: loop.train_step()


def time_rounds(variants: dict[str, Callable[[], None]], rounds: int, steps: int,
                device: torch.device) -> dict[str, list[float]]:
    """Seconds per step for each variant, rounds alternating; one untimed warm-up step each first.

    On a GPU each step is timed until its queued kernels have finished.
    """
    for step in variants.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            for _ in range(steps):
                start = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    # --quick sets only what was not given, so a test can ask for a tinier run (tests/test_benchmarks.py)
    rounds = args.rounds or (3 if args.quick else 6)
    steps = args.steps_per_round or (3 if args.quick else 5)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, precision=args.precision, max_steps=1000,
                        compile=args.compile)
    seed_everything(train.seed)
    shape = ModelShape(MODEL_PRESETS[args.preset], args.vocab_size, args.seq_len)
    tokens = token_rows(args.vocab_size, args.seq_len)
    accelerator = build_accelerator(train)  # the GPU when CUDA is available, else the CPU: both variants run there
    device = accelerator.device
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as scratch:
        hf_llama = HuggingFaceSpec(CONFIG_MAPPING["llama"].from_dict(hf_llama_config(shape)), args.seq_len)
        variants = {"bare PyTorch loop": bare_pytorch_step(shape, train, tokens, device),
                    "tokenmill TrainingLoop (Accelerate)": tokenmill_step(BuiltinSpec(shape), train, tokens,
                                                                          Path(scratch), accelerator),
                    HF_VARIANT: tokenmill_step(hf_llama, train, tokens, Path(scratch), accelerator)}
        times = time_rounds(variants, rounds, steps, device)
    tokens_per_step = args.micro_batch_size * args.seq_len
    rate = {name: tokens_per_step / statistics.median(values) for name, values in times.items()}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"threads={torch.get_num_threads()}"
    print(f"preset={args.preset} vocab={args.vocab_size} seq_len={args.seq_len} micro_batch={args.micro_batch_size} "
          f"precision={args.precision} compile={args.compile} device={device.type} {where} "
          f"steps/variant={rounds * steps}")
    print(f"{'variant':40} {'median s/step':>14} {'tokens/s':>10}")
    for name, values in times.items():
        print(f"{name:40} {statistics.median(values):14.3f} {rate[name]:10,.0f}")
    baseline, ours = rate["bare PyTorch loop"], rate["tokenmill TrainingLoop (Accelerate)"]
    print(f"built-in model / transformers LlamaForCausalLM (same loop, same dims): {ours / rate[HF_VARIANT]:.3f}x")
    peak = device_peak(device, args.precision, None, None)
    model_flops = flops_per_token(shape, build_model(shape, 0).num_parameters()) * ours / 1e12
    print(f"MFU {model_flops / peak.tflops:.1%} ({model_flops * 1e3:.1f} model GFLOP/s of a {peak.tflops * 1e3:.0f} "
          f"GFLOP/s matmul peak, {peak.source})")
    return print_result("train_step", ours, baseline, "tokens/s")


if __name__ == "__main__":
    main()
