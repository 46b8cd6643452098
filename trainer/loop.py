"""Training loop: loader batches -> optimizer steps on Accelerate, with evaluation, metrics and checkpoints on schedule.

``TrainingLoop`` only composes collaborators built elsewhere from the configs (model, AdamW, warmup +
cosine LambdaLR, TrainLoader, Evaluator, Checkpointer, MetricsSink); this module also holds the small
builders for the optimizer, the schedule and the Accelerator.
"""

from __future__ import annotations

import functools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from pipeline.errors import CheckpointError, ConfigError
from trainer.checkpoint import Checkpointer
from trainer.config import TrainConfig
from trainer.data import TrainLoader
from trainer.evaluate import Evaluator
from trainer.metrics import MetricsSink
from trainer.model import ModelShape

ADAM_BETAS = (0.9, 0.95)
"""The usual LLM-pretraining betas (GPT-3, Llama): a shorter second-moment memory than 0.999 is more stable."""


def mixed_precision_for(precision: str, on_gpu: bool) -> str:
    """Accelerate's ``mixed_precision`` for ``train.precision``; refuses fp16 and warns about bf16 on CPU."""
    if precision == "fp32":
        return "no"
    if precision == "fp16" and not on_gpu:
        raise ConfigError("train.precision=fp16 needs a GPU (on CPU Accelerate silently runs fp32 instead); "
                          "set train.precision: fp32.")
    if precision == "bf16" and not on_gpu:
        warnings.warn("train.precision=bf16 on CPU: without AVX512-BF16/AMX bf16 matmuls run ~20x slower than "
                      "fp32; set train.precision: fp32 for CPU runs.", stacklevel=2)
    return precision


def build_accelerator(train: TrainConfig) -> Accelerator:
    """The Accelerator for this run: precision from the recipe, our own scheduler stepping (see below)."""
    on_gpu = torch.cuda.is_available()
    mixed = mixed_precision_for(train.precision, on_gpu=on_gpu)
    # cpu=True on a GPU-less machine: without it Accelerate 1.15 ignores torchrun's WORLD_SIZE there and
    # every launched process trains alone (DistributedType.NO); with it they form a gloo group (MULTI_CPU).
    # step_scheduler_with_optimizer=False: Accelerate would otherwise step the schedule once per
    # *process* each optimizer step; ours counts optimizer steps, whatever the number of processes.
    return Accelerator(cpu=not on_gpu, mixed_precision=mixed, gradient_accumulation_steps=train.grad_accum_steps,
                       step_scheduler_with_optimizer=False)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch and ask torch for deterministic kernels (warn where none exists)."""
    set_seed(seed)
    # cuBLAS is deterministic only with a fixed workspace; read when its first handle is created.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the projection matrices only.

    Norm gains and the (tied) embedding are not decayed: decay pulls gains away from 1 for no benefit,
    and it would shrink the rows of rare tokens on every step although their gradients are rare.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=ADAM_BETAS, eps=1e-8)


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup, then cosine to the floor."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> LambdaLR:
    """Warmup + cosine as a LambdaLR; the schedule comes from the recipe, so a raised max_steps takes effect."""
    schedule = functools.partial(lr_factor, warmup_steps=train.warmup_steps, max_steps=train.max_steps,
                                 min_lr_ratio=train.min_lr_ratio)
    return LambdaLR(optimizer, schedule)


@dataclass
class LoopCounters:
    """Optimizer steps taken and tokens processed (all ranks, padding included)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass(frozen=True)
class ModelSignature:
    """Stateful guard: a checkpoint only resumes into a model of the same shape."""

    shape: ModelShape

    def state_dict(self) -> dict[str, Any]:
        return {"dims": self.shape.dims.model_dump(), "vocab_size": self.shape.vocab_size,
                "max_seq_len": self.shape.max_seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != self.state_dict():
            raise CheckpointError(f"the checkpoint's model ({state}) differs from the recipe's "
                                  f"({self.state_dict()}); restore the recipe's model section, or delete "
                                  "checkpoints/ to train the new model from scratch.")


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured on this rank (loss is the mean over its micro-batches)."""

    loss: torch.Tensor
    grad_norm: float
    lr: float
    seconds: float


@dataclass
class TrainingLoop:
    """Runs optimizer steps to a target, evaluating, logging and checkpointing on the recipe's schedule."""

    accelerator: Accelerator
    model: nn.Module
    optimizer: Any
    scheduler: Any
    loader: TrainLoader
    evaluator: Evaluator
    checkpointer: Checkpointer
    metrics: MetricsSink
    train: TrainConfig
    counters: LoopCounters
    flops_per_token: float = 0.0
    _window: list[StepResult] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        return self.loader.layout.global_batch_size * self.loader.rows.seq_len

    def train_step(self) -> StepResult:
        """One optimizer step over ``grad_accum_steps`` micro-batches (gradients synced on the last one)."""
        start = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss_sum, grad_norm = torch.zeros((), dtype=torch.float64, device=self.accelerator.device), math.nan
        batches = self.loader.next_step()
        for batch in batches:
            with self.accelerator.accumulate(self.model):
                loss = self.model(batch.input_ids.to(self.accelerator.device), batch.labels.to(self.accelerator.device))
                self.accelerator.backward(loss)
                loss_sum += loss.detach().double()
                if self.accelerator.sync_gradients:
                    grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), self.train.grad_clip))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        assert self.accelerator.sync_gradients, "the last micro-batch of a step must sync gradients"
        if not self.optimizer.step_was_skipped:  # fp16 loss scaling skips steps with inf/nan gradients
            self.scheduler.step()
        self.counters.step += 1
        self.counters.tokens_seen += self.tokens_per_step
        return StepResult(loss_sum / len(batches), grad_norm, lr, time.perf_counter() - start)

    def run(self, target_step: int) -> None:
        """Train until ``counters.step == target_step``; evaluates at step 0, on schedule and at the end."""
        if self.counters.step == 0:
            self.evaluate()
        while self.counters.step < target_step:
            self._window.append(self.train_step())
            step = self.counters.step
            if step % self.train.log_every == 0 or step in (1, target_step):
                self.log_window(target_step)
            if step % self.train.eval_every == 0 or step == target_step:
                self.evaluate()
            if step % self.train.checkpoint_every == 0 or step == target_step:
                self.checkpointer.save(step)

    def log_window(self, target_step: int) -> None:
        """Write one train row (and a progress line) for the steps since the last row; collective (loss mean)."""
        last = self._window[-1]
        loss = float(self.accelerator.reduce(last.loss, reduction="mean"))
        seconds = sum(result.seconds for result in self._window)
        tokens_per_s = self.tokens_per_step * len(self._window) / max(seconds, 1e-9)
        row = {"step": self.counters.step, "loss": loss, "lr": last.lr, "grad_norm": last.grad_norm,
               "tokens_seen": self.counters.tokens_seen, "tokens_per_s": tokens_per_s,
               "step_time_s": seconds / len(self._window), "epoch": self.loader.epoch,
               "model_tflops_per_s": tokens_per_s * self.flops_per_token / 1e12}
        self._window.clear()
        self.metrics.log_train(row)
        self.accelerator.print(f"step {row['step']}/{target_step} | loss {loss:.4f} | lr {last.lr:.2e} | "
                               f"grad_norm {last.grad_norm:.3f} | {tokens_per_s:,.0f} tokens/s", flush=True)

    def evaluate(self) -> dict[str, float] | None:
        """Validation on the fixed subset; writes an eval row and prints it."""
        result = self.evaluator.evaluate(self.model)
        if result is None:
            self.accelerator.print("eval skipped: no split=val shards in the index", flush=True)
            return None
        row = {"step": self.counters.step, "tokens_seen": self.counters.tokens_seen, **result}
        self.metrics.log_eval(row)
        self.accelerator.print(f"eval step {row['step']} | val_loss {row['val_loss']:.4f} | "
                               f"val_ppl {row['val_ppl']:.2f}", flush=True)
        return row
