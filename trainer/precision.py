"""Precision: ``train.precision`` -> autocast dtype around forward passes, and dynamic loss scaling for fp16.

The trainer does mixed precision itself instead of through Accelerate's ``mixed_precision`` (which it
sets to ``"no"``): Accelerate silently runs fp16 as fp32 on a CPU (docs/library-facts.md), so its loss scaler could
never be exercised there. Weights and AdamW state stay fp32 (the "master" copy) in every mode; only
the matmuls inside ``autocast()`` run in bf16/fp16. For fp16, a ``GradScaler`` multiplies the loss
before backward, unscales the gradients before clipping, skips the update when they overflowed
(inf/NaN) and halves the scale, and doubles it again after ``growth_interval`` clean steps.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from core.errors import ConfigError

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""train.precision -> the dtype autocast computes in (None: no autocast)."""


CPU_HALF_SUPPORT = {"bf16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
                    "fp16": ("_is_amx_fp16_supported",)}
"""torch.cpu probes (private, hence looked up defensively) for native half-precision matmuls on this CPU."""


def cpu_has_native(precision: str) -> bool:
    """True when this CPU multiplies ``precision`` natively (AVX512-BF16/AMX for bf16, AMX-FP16 for fp16)."""
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in CPU_HALF_SUPPORT[precision])


def check_precision(precision: str, on_gpu: bool) -> None:
    """Refuse a precision the device cannot run; warn when it runs but much slower than fp32 (most CPUs)."""
    if precision == "fp32":
        return
    if on_gpu:
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision=bf16: this GPU has no bf16 support (pre-Ampere); "
                              "set train.precision: fp16.")
        return
    if not cpu_has_native(precision):
        needs = "AVX512-BF16/AMX" if precision == "bf16" else "AMX-FP16"
        warnings.warn(f"train.precision={precision} on CPU: without {needs}, {precision} matmuls run ~5-200x "
                      "slower than fp32 here; set train.precision: fp32 for CPU runs.", stacklevel=2)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's wrapper (the GradScaler keys its bookkeeping on it)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def make_grad_scaler(device_type: str, growth_interval: int, sharded: bool) -> torch.amp.GradScaler:
    """A dynamic loss scaler; the sharded one all-reduces the overflow flag (FSDP ranks hold different grads)."""
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # FSDP (~1.8 s): only with FSDP

        return ShardedGradScaler(device=device_type, growth_interval=growth_interval)
    return torch.amp.GradScaler(device_type, growth_interval=growth_interval)


class MixedPrecision:
    """Autocast + (fp16) loss scaling for the training step; ``state_dict()`` is the scaler's state (JSON)."""

    def __init__(self, precision: str, device_type: str, growth_interval: int = 2000, sharded: bool = False) -> None:
        self.precision, self.device_type = precision, device_type
        self.dtype = AUTOCAST_DTYPES[precision]
        self.scaler = make_grad_scaler(device_type, growth_interval, sharded) if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for forward passes: compute in bf16/fp16, keep fp32 where autocast says so (norms, loss)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: multiplied by the current loss scale under fp16, else unchanged."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients by the loss scale in place (before clipping); records whether they overflowed."""
        if self.scaler is not None:
            self.scaler.unscale_(unwrap_optimizer(optimizer))

    def step(self, optimizer: Any, allowed: bool) -> bool:
        """Apply the update if ``allowed`` and (fp16) the gradients are finite; returns whether it was applied.

        Under fp16 an overflow skips the update and halves the scale; the scaler is updated either way.
        """
        if self.scaler is None:
            if allowed:
                optimizer.step()
            return allowed
        scale_before = self.scaler.get_scale()
        if allowed:
            self.scaler.step(unwrap_optimizer(optimizer))
        self.scaler.update()
        return allowed and self.scaler.get_scale() >= scale_before  # the scale shrinks only on an overflow

    @property
    def loss_scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else dict(self.scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
