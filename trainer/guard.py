"""Non-finite guard: a step's loss and gradient norm -> apply or skip its update; too many bad steps in a row stop.

One NaN/inf step (a poisoned batch, a spike) is skipped and counted; ``train.max_nonfinite_steps`` in
a row mean the weights or the optimizer state are broken, and more steps only burn compute, so
training stops with an error naming the step and the newest checkpoint (saved before the streak).
Under fp16 an overflowing gradient is the loss scaler's business (it skips and lowers the scale), so
only a non-finite *loss* counts there. The decision uses the loss averaged over all ranks and the
global gradient norm, so every rank decides alike.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from core.errors import TrainingDivergedError


class GuardCounters(Protocol):
    """Where the guard keeps its counts (the loop counters, so they are checkpointed with the step)."""

    skipped_steps: int
    nonfinite_in_a_row: int


class NonFiniteGuard:
    """Decides whether an update may be applied, and stops training after ``max_in_a_row`` bad steps."""

    def __init__(self, max_in_a_row: int, counters: GuardCounters) -> None:
        self.max_in_a_row, self.counters = max_in_a_row, counters

    @staticmethod
    def is_finite(loss: float, grad_norm: float | None, loss_scaled: bool) -> bool:
        """A finite loss, and a finite gradient norm unless a loss scaler owns overflows (or none is known)."""
        grad_ok = loss_scaled or grad_norm is None or math.isfinite(grad_norm)
        return math.isfinite(loss) and grad_ok

    def record(self, finite: bool, applied: bool) -> None:
        """Count the step: skipped updates in total, and non-finite steps in a row."""
        self.counters.nonfinite_in_a_row = 0 if finite else self.counters.nonfinite_in_a_row + 1
        if not applied:
            self.counters.skipped_steps += 1

    @property
    def in_streak(self) -> bool:
        """The latest step was non-finite (its weights are suspect: do not checkpoint them)."""
        return self.counters.nonfinite_in_a_row > 0

    @property
    def should_stop(self) -> bool:
        return self.counters.nonfinite_in_a_row >= self.max_in_a_row

    def stop_error(self, step: int, last_checkpoint: str | None) -> TrainingDivergedError:
        """The one-line error to stop with at ``step``."""
        first_bad = step - self.counters.nonfinite_in_a_row + 1
        where = f"last good checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
        return TrainingDivergedError(
            f"step {step}: non-finite loss or gradient norm for {self.counters.nonfinite_in_a_row} steps in a row "
            f"(since step {first_bad}; train.max_nonfinite_steps={self.max_in_a_row}); {where}. Lower train.lr "
            "or raise train.warmup_steps, then resume (delete newer checkpoints to restart from it).")


def state_counts(state: dict[str, Any]) -> tuple[int, int]:
    """(skipped_steps, nonfinite_in_a_row) from loop-counter state; 0 for checkpoints older than the guard."""
    return int(state.get("skipped_steps", 0)), int(state.get("nonfinite_in_a_row", 0))
