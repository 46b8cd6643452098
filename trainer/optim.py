"""Optimizer and schedule: model parameters -> AdamW (decay on matrices only) and a warmup + cosine LambdaLR."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import TrainConfig

ADAM_BETAS = (0.9, 0.95)
"""The usual LLM-pretraining betas (GPT-3, Llama): a shorter second-moment memory than 0.999 is more stable."""


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on the projection matrices only.

    Norm gains and the (tied) embedding are not decayed: decay pulls gains away from 1 for no benefit,
    and it would shrink the rows of rare tokens on every step although their gradients are rare.
    """
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():  # each once, also when tied
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
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
