"""Loss-spike guard: a step's loss -> spike or not (z-score over the recent losses); K spikes in a row -> roll back.

A spike is a finite loss more than ``train.spike_zscore`` standard deviations above the mean of the last
``train.spike_window`` applied steps' losses (judged only once that many are known). Its update is skipped as a
non-finite step's is (the batch is consumed, ``skipped_steps`` counts it, the LR schedule does not advance) and
``spike_steps`` counts it. ``train.max_spikes_in_a_row`` spikes in a row mean the weights themselves are
drifting, so the loop rolls back to the newest checkpoint (saved before the streak) and goes on from the data
after the streak: the batches since that checkpoint are skipped (PaLM's remedy). The decision uses the loss
averaged over all ranks, so every rank decides alike; the window is in the loop counters, so it is checkpointed
and a resumed run judges the same steps the same way.
"""

from __future__ import annotations

import math
from typing import Protocol


class SpikeCounters(Protocol):
    """Where the guard keeps its state (the loop counters, so they are checkpointed with the step)."""

    spike_steps: int
    spikes_in_a_row: int
    rollbacks: int
    recent_losses: list[float]


class SpikeGuard:
    """Judges each finite loss against the recent ones; None ``zscore`` = off (nothing is ever a spike)."""

    def __init__(self, zscore: float | None, window: int, max_in_a_row: int, counters: SpikeCounters) -> None:
        self.zscore, self.window, self.max_in_a_row, self.counters = zscore, window, max_in_a_row, counters

    def z_score(self, loss: float) -> float | None:
        """How many standard deviations ``loss`` lies above the window's mean; None until the window is full."""
        recent = self.counters.recent_losses
        if self.zscore is None or len(recent) < self.window:
            return None
        mean = math.fsum(recent) / len(recent)
        std = math.sqrt(math.fsum((value - mean) ** 2 for value in recent) / len(recent))
        return (loss - mean) / max(std, 1e-12)  # identical recent losses: any rise is a spike, with a finite z

    def is_spike(self, loss: float) -> bool:
        """True when the guard is on, the window full, and ``loss`` (finite) is above mean + zscore * std."""
        z = self.z_score(loss) if math.isfinite(loss) else None
        return z is not None and z > self.zscore

    def record(self, loss: float, spike: bool, applied: bool) -> None:
        """Count a spike, or end a streak; an applied update's loss joins the window (the oldest leaves)."""
        if spike:
            self.counters.spike_steps += 1
            self.counters.spikes_in_a_row += 1
            return
        if math.isfinite(loss):
            self.counters.spikes_in_a_row = 0
        if applied and self.zscore is not None:
            self.counters.recent_losses = [*self.counters.recent_losses, loss][-self.window:]

    @property
    def in_streak(self) -> bool:
        """The latest step was a spike (do not checkpoint: the newest checkpoint must predate the streak)."""
        return self.counters.spikes_in_a_row > 0

    @property
    def should_roll_back(self) -> bool:
        return self.counters.spikes_in_a_row >= self.max_in_a_row

    def rolled_back(self) -> None:
        """The loop rolled back: the streak is over, one more rollback is counted."""
        self.counters.spikes_in_a_row = 0
        self.counters.rollbacks += 1
