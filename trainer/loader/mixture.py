"""Mixture: per-source weights (``mixture:`` in run.yaml) -> a deterministic, weighted interleave of the sources' rows.

The global sample sequence is cut into blocks of ``BLOCK_SAMPLES``. Block ``b`` gives each source its
share of the block (``weight * BLOCK_SAMPLES``, rounded by largest remainder, so shares are exact to
1/BLOCK_SAMPLES in every block) and shuffles the labels with ``np.random.default_rng([seed, MIX_SALT, b])``:
sample ``k`` comes from source ``S(k)``, a pure function of (seed, k). A source's own ``i``-th sample
is its row ``perm_{s,e}[i mod N_s]`` with ``e = i // N_s`` and ``perm_{s,e}`` a permutation seeded
by (seed, source name, e): a small source with a large weight is simply repeated in fresh orders.
The state is the global position plus the samples taken from each source: a few JSON integers, so
resuming is O(1), and it does not depend on the number of processes.

A schedule (``mixture_schedule:``) is a list of stages, each with its weights up to an optimizer step
(``until_step``). A ``take`` is one optimizer step (the loader takes one global batch per step; ``num_steps``
says how many a longer take holds), so the order counts steps itself: the step after ``until_step`` starts the
next stage at its first sample, and the blocks restart there (block ``b`` of stage ``i`` begins
``b * BLOCK_SAMPLES`` samples after the stage's start).
Where a stage starts is saved (``stage_start``), so a resume with another global batch size (another number
of processes) keeps every sample where it was. ``max_repetition`` drops a source at the start of the first
block that would take it past that many epochs (the rest renormalised), so it is never seen more; the
dropped sources are saved too. A static ``mixture:`` is one stage that never ends (its order is unchanged).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import CheckpointError, ConfigError, TokenmillError

BLOCK_SAMPLES = 1024
"""Samples per schedule block: every block holds each source's weight share to within one sample."""

MIX_SALT = 0x6D6978
"""Separates the source schedule's random stream from the per-source row orders ("mix")."""


def resolve_weights(weights: dict[str, float], rows_per_source: dict[str, int],
                    key: str = "mixture") -> dict[str, float]:
    """Normalised weights for the sources that have train rows; ConfigError names what to fix.

    Every source in the shards needs a weight (0 leaves it out); a weighted source without train
    rows is dropped with a warning.
    """
    unweighted = sorted(set(rows_per_source) - set(weights))
    if unweighted:
        raise ConfigError(f"run.yaml: {key}: no weight for source(s) {unweighted} found in the train shards; "
                          "add them (0 leaves a source out) or remove the mixture section for equal rows.")
    absent = sorted(name for name, weight in weights.items() if weight > 0 and not rows_per_source.get(name))
    if absent:
        warnings.warn(f"{key}: source(s) {absent} have a weight but no train rows; they are left out", stacklevel=2)
    kept = {name: float(weights[name]) for name in sorted(rows_per_source) if rows_per_source[name] > 0}
    total = sum(kept.values())
    if total <= 0:
        raise ConfigError(f"run.yaml: {key}: the weights of the sources with train rows sum to 0; "
                          "give at least one of them a positive weight.")
    return {name: weight / total for name, weight in kept.items() if weight > 0}


def block_counts(weights: np.ndarray, block: int) -> np.ndarray:
    """Samples per source in one block: ``weights * block`` rounded by largest remainder (sums to ``block``)."""
    ideal = weights * block
    counts = np.floor(ideal).astype(np.int64)
    short = block - int(counts.sum())
    order = np.lexsort((np.arange(len(weights)), -(ideal - counts)))  # largest remainder, then source order
    counts[order[:short]] += 1
    return counts


def source_key(name: str) -> int:
    """A stable integer per source name (seeds its row order whatever other sources exist)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


class MixtureExhaustedError(TokenmillError):
    """Every source of the current stage has been seen ``max_repetition`` epochs: nothing is left to train on."""


@dataclass(frozen=True)
class MixtureStage:
    """One stage of a schedule: normalised weights (see resolve_weights) up to optimizer step ``until_step``."""

    until_step: int | None
    """Last optimizer step of the stage (inclusive); None = until training ends."""
    weights: dict[str, float]


class MixtureOrder:
    """Row numbers of consecutive global samples under the weights; call ``take`` once per step, in sample order."""

    def __init__(self, source_rows: dict[str, np.ndarray], weights: dict[str, float], seed: int,
                 stages: list[MixtureStage] | None = None, max_repetition: dict[str, float] | None = None) -> None:
        """``source_rows``: each source's global row numbers; ``weights``: normalised (see resolve_weights).

        ``stages``: a schedule (``weights`` is then ignored); ``max_repetition``: {source: epochs} it may be seen.
        """
        self.scheduled = stages is not None
        self.stages = list(stages) if stages is not None else [MixtureStage(None, dict(weights))]
        self.names = sorted({name for stage in self.stages for name in stage.weights})
        self.source_rows = {name: np.asarray(source_rows[name], dtype=np.int64) for name in self.names}
        self.seed = seed
        self.max_samples = {name: math.floor(epochs * len(self.source_rows[name]))
                            for name, epochs in (max_repetition or {}).items() if name in self.source_rows}
        self.max_repetition = dict(max_repetition or {})
        self.warn = True
        """Warn when a source is dropped (the loader sets it on rank 0 only)."""
        self.position, self.step, self.stage, self.stage_start = 0, 0, 0, 0
        self.taken = dict.fromkeys(self.names, 0)
        self.dropped: dict[str, int] = {}
        """{source: the step it was dropped at}, in the order they were dropped."""
        self.window_counts: Counter[tuple[int, str]] = Counter()
        """Samples per (stage, source) since the last ``pop_window_counts`` (the metrics rows)."""
        self._block: tuple[tuple[int, int, tuple[str, ...]], np.ndarray] | None = None
        self._orders: dict[str, tuple[int, np.ndarray]] = {}

    @property
    def weights(self) -> dict[str, float]:
        """The current stage's weights (as configured, before any source was dropped)."""
        return dict(self.stages[self.stage].weights)

    def stage_of(self, step: int) -> int:
        """Index of the stage optimizer step ``step`` (1-based) belongs to; past the last ``until_step``, the last."""
        for index, stage in enumerate(self.stages):
            if stage.until_step is None or step <= stage.until_step:
                return index
        return len(self.stages) - 1

    def active_counts(self) -> np.ndarray:
        """Samples per source (``self.names`` order) in a block of the current stage, without the dropped sources."""
        weights = np.array([0.0 if name in self.dropped else self.stages[self.stage].weights.get(name, 0.0)
                            for name in self.names])
        if weights.sum() <= 0:
            raise MixtureExhaustedError(
                f"step {self.step + 1}: every source of mixture stage {self.stage} has been seen its max_repetition "
                f"epochs (dropped: {sorted(self.dropped)}); raise mixture_schedule.max_repetition, add data, or "
                f"stop at step {self.step} (the last checkpoint holds the run so far).")
        return block_counts(weights / weights.sum(), BLOCK_SAMPLES)

    def drop_exhausted(self) -> None:
        """At a block start: drop each source whose share of the block would pass its max_repetition."""
        while True:
            counts = self.active_counts()
            over = [name for index, name in enumerate(self.names) if name in self.max_samples
                    and name not in self.dropped and counts[index]
                    and self.taken[name] + counts[index] > self.max_samples[name]]
            if not over:
                return
            for name in over:
                self.dropped[name] = self.step + 1
                if self.warn:
                    warnings.warn(f"mixture: source {name!r} dropped from the mix at step {self.step + 1}: it has been "
                                  f"seen {self.taken[name] / len(self.source_rows[name]):.2f} epochs and its "
                                  f"max_repetition is {self.max_repetition[name]}; the other sources' weights are "
                                  "renormalised", stacklevel=4)

    def block_sources(self, block: int) -> np.ndarray:
        """Source index (into ``self.names``) of every sample in block ``block`` of the current stage."""
        key = (self.stage, block, tuple(self.dropped))
        if self._block is None or self._block[0] != key:
            labels = np.repeat(np.arange(len(self.names)), self.active_counts())
            entropy = [self.seed, MIX_SALT, block] + ([self.stage] if self.stage else [])  # stage 0: the static order
            self._block = (key, np.random.default_rng(entropy).permutation(labels))
        return self._block[1]

    def source_order(self, name: str, epoch: int) -> np.ndarray:
        """Source ``name``'s rows in the order its epoch ``epoch`` visits them (cached per source)."""
        cached = self._orders.get(name)
        if cached is None or cached[0] != epoch:
            rows = self.source_rows[name]
            order = rows[np.random.default_rng([self.seed, source_key(name), epoch]).permutation(len(rows))]
            self._orders[name] = cached = (epoch, order)
        return cached[1]

    def take(self, start: int, count: int, num_steps: int = 1) -> np.ndarray:
        """Row numbers of global samples ``start ..`` (``start`` is where the previous take ended): the next
        ``num_steps`` optimizer steps of ``count // num_steps`` samples each (a schedule switches stages by step).

        Raises MixtureExhaustedError when max_repetition leaves no source to take from.
        """
        if start != self.position:
            raise CheckpointError(f"mixture order is at sample {self.position}, asked for {start}; the loader "
                                  "and mixture states disagree: delete checkpoints/ to start over.")
        if num_steps < 1 or count % num_steps:
            raise ValueError(f"take: {count} samples do not split into {num_steps} equal steps")
        size = count // num_steps
        return np.concatenate([self._take_step(start + i * size, size) for i in range(num_steps)])

    def _take_step(self, start: int, count: int) -> np.ndarray:
        """One optimizer step's samples: switches the stage at the step after ``until_step``."""
        stage = self.stage_of(self.step + 1)
        if stage != self.stage:  # the step after until_step: the next stage begins here, its blocks with it
            self.stage, self.stage_start = stage, start
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            block, offset = divmod(start + done - self.stage_start, BLOCK_SAMPLES)
            if offset == 0 and self.max_samples:
                self.drop_exhausted()
            size = min(count - done, BLOCK_SAMPLES - offset)
            out[done:done + size] = self._rows_of(self.block_sources(block)[offset:offset + size])
            done += size
        self.position += count
        self.step += 1
        return out

    def _rows_of(self, sources: np.ndarray) -> np.ndarray:
        """Each sample's row, from its source's next rows in that source's order; advances ``taken``."""
        out = np.empty(len(sources), dtype=np.int64)
        for index, name in enumerate(self.names):
            picked = np.flatnonzero(sources == index)
            taken = self.taken[name] + np.arange(len(picked), dtype=np.int64)
            epochs, positions = np.divmod(taken, len(self.source_rows[name]))
            for epoch in np.unique(epochs):
                in_epoch = epochs == epoch
                out[picked[in_epoch]] = self.source_order(name, int(epoch))[positions[in_epoch]]
            self.taken[name] += len(picked)
            if len(picked):
                self.window_counts[(self.stage, name)] += len(picked)
        return out

    def pop_window_counts(self) -> list[dict[str, Any]]:
        """``[{stage, source, samples}]`` taken since the last call (a metrics row's ``mix`` column), then reset."""
        rows = [{"stage": stage, "source": name, "samples": samples}
                for (stage, name), samples in sorted(self.window_counts.items())]
        self.window_counts.clear()
        return rows

    def schedule_state(self) -> list[dict[str, Any]]:
        return [{"until_step": stage.until_step, "weights": dict(stage.weights)} for stage in self.stages]

    def state_dict(self) -> dict[str, Any]:
        state = {"position": self.position, "source_samples": dict(self.taken), "weights": self.weights,
                 "step": self.step}
        if self.scheduled:
            state.update(stage=self.stage, stage_start=self.stage_start, dropped=dict(self.dropped),
                         schedule=self.schedule_state(), max_repetition=dict(self.max_repetition))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; changed weights or a changed schedule apply from here on (warning).

        A state saved before steps were counted needs ``step`` filled in by the caller (the loader does).
        """
        self.position, self.step = int(state["position"]), int(state["step"])
        self.taken = {name: int(state["source_samples"].get(name, 0)) for name in self.names}
        self.dropped = {name: int(step) for name, step in state.get("dropped", {}).items() if name in self.taken}
        self.stage, self.stage_start = int(state.get("stage", 0)), int(state.get("stage_start", 0))
        if not self.scheduled:
            if state["weights"] != self.weights:
                warnings.warn(f"mixture weights changed since the checkpoint ({state['weights']} -> "
                              f"{self.weights}); the new weights apply from here on", stacklevel=3)
            if "schedule" in state:  # a schedule's checkpoint continued with static weights: a fresh stage 0 here
                self.stage, self.stage_start, self.dropped = 0, self.position, {}
            return
        if state.get("schedule") != self.schedule_state():
            if self.warn:
                warnings.warn(f"mixture_schedule changed since the checkpoint at step {self.step}; the new schedule "
                              f"applies from step {self.step + 1} on (its stage's blocks restart there)", stacklevel=3)
            self.stage = -1  # the next take starts the step's stage afresh at the resume position
        if self.stage >= len(self.stages):
            self.stage = -1
