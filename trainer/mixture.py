"""Mixture: per-source weights (``mixture:`` in run.yaml) -> a deterministic, weighted interleave of the sources' rows.

The global sample sequence is cut into blocks of ``BLOCK_SAMPLES``. Block ``b`` gives each source its
share of the block (``weight * BLOCK_SAMPLES``, rounded by largest remainder, so shares are exact to
1/BLOCK_SAMPLES in every block) and shuffles the labels with ``np.random.default_rng([seed, MIX_SALT, b])``:
sample ``k`` comes from source ``S(k)``, a pure function of (seed, k). A source's own ``i``-th sample
is its row ``perm_{s,e}[i mod N_s]`` with ``e = i // N_s`` and ``perm_{s,e}`` a permutation seeded
by (seed, source name, e): a small source with a large weight is simply repeated in fresh orders.
The state is the global position plus the samples taken from each source: a few JSON integers, so
resuming is O(1), and it does not depend on the number of processes.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np

from core.errors import CheckpointError, ConfigError

BLOCK_SAMPLES = 1024
"""Samples per schedule block: every block holds each source's weight share to within one sample."""

MIX_SALT = 0x6D6978
"""Separates the source schedule's random stream from the per-source row orders ("mix")."""


def resolve_weights(weights: dict[str, float], rows_per_source: dict[str, int]) -> dict[str, float]:
    """Normalised weights for the sources that have train rows; ConfigError names what to fix.

    Every source in the shards needs a weight (0 leaves it out); a weighted source without train
    rows is dropped with a warning.
    """
    unweighted = sorted(set(rows_per_source) - set(weights))
    if unweighted:
        raise ConfigError(f"run.yaml: mixture: no weight for source(s) {unweighted} found in the train shards; "
                          "add them (0 leaves a source out) or remove the mixture section for equal rows.")
    absent = sorted(name for name, weight in weights.items() if weight > 0 and not rows_per_source.get(name))
    if absent:
        warnings.warn(f"mixture: source(s) {absent} have a weight but no train rows; they are left out", stacklevel=2)
    kept = {name: float(weights[name]) for name in sorted(rows_per_source) if rows_per_source[name] > 0}
    total = sum(kept.values())
    if total <= 0:
        raise ConfigError("run.yaml: mixture: the weights of the sources with train rows sum to 0; "
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


class MixtureOrder:
    """Row numbers of consecutive global samples under the weights; call ``take`` in sample order."""

    def __init__(self, source_rows: dict[str, np.ndarray], weights: dict[str, float], seed: int) -> None:
        """``source_rows``: each source's global row numbers; ``weights``: normalised (see resolve_weights)."""
        self.names = sorted(weights)
        self.source_rows = {name: np.asarray(source_rows[name], dtype=np.int64) for name in self.names}
        self.weights, self.seed = dict(weights), seed
        self.counts = block_counts(np.array([weights[name] for name in self.names]), BLOCK_SAMPLES)
        self.position = 0
        self.taken = dict.fromkeys(self.names, 0)
        self._block: tuple[int, np.ndarray] | None = None
        self._orders: dict[str, tuple[int, np.ndarray]] = {}

    def block_sources(self, block: int) -> np.ndarray:
        """Source index (into ``self.names``) of every sample in schedule block ``block``."""
        if self._block is None or self._block[0] != block:
            labels = np.repeat(np.arange(len(self.names)), self.counts)
            self._block = (block, np.random.default_rng([self.seed, MIX_SALT, block]).permutation(labels))
        return self._block[1]

    def sources(self, start: int, count: int) -> np.ndarray:
        """Source index of global samples ``start .. start + count - 1``."""
        samples = np.arange(start, start + count, dtype=np.int64)
        blocks, offsets = np.divmod(samples, BLOCK_SAMPLES)
        out = np.empty(count, dtype=np.int64)
        for block in np.unique(blocks):
            mask = blocks == block
            out[mask] = self.block_sources(int(block))[offsets[mask]]
        return out

    def source_order(self, name: str, epoch: int) -> np.ndarray:
        """Source ``name``'s rows in the order its epoch ``epoch`` visits them (cached per source)."""
        cached = self._orders.get(name)
        if cached is None or cached[0] != epoch:
            rows = self.source_rows[name]
            order = rows[np.random.default_rng([self.seed, source_key(name), epoch]).permutation(len(rows))]
            self._orders[name] = cached = (epoch, order)
        return cached[1]

    def take(self, start: int, count: int) -> np.ndarray:
        """Row numbers of global samples ``start ..`` (``start`` must be where the previous take ended)."""
        if start != self.position:
            raise CheckpointError(f"mixture order is at sample {self.position}, asked for {start}; the loader "
                                  "and mixture states disagree: delete checkpoints/ to start over.")
        sources = self.sources(start, count)
        out = np.empty(count, dtype=np.int64)
        for index, name in enumerate(self.names):
            mask = sources == index
            taken = self.taken[name] + np.arange(int(mask.sum()), dtype=np.int64)
            epochs, positions = np.divmod(taken, len(self.source_rows[name]))
            for epoch in np.unique(epochs):
                in_epoch = epochs == epoch
                picked = np.flatnonzero(mask)[in_epoch]
                out[picked] = self.source_order(name, int(epoch))[positions[in_epoch]]
            self.taken[name] += int(mask.sum())
        self.position += count
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "source_samples": dict(self.taken), "weights": dict(self.weights)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; changed weights apply from here on (with a warning)."""
        if state["weights"] != self.weights:
            warnings.warn(f"mixture weights changed since the checkpoint ({state['weights']} -> {self.weights}); "
                          "the new weights apply from here on", stacklevel=3)
        self.position = int(state["position"])
        self.taken = {name: int(state["source_samples"].get(name, 0)) for name in self.names}
