"""Reference log-probs: the reference model's summed log-probs of each pair's sides, computed once, then read back.

DPO needs ``ref_c`` and ``ref_r`` for every pair; they depend only on the reference model's weights and the pair's
tokens, so a stage computes them once (:func:`compute_reference_logps`) and stores them per pair
(:func:`store_reference_logps`, the file of :mod:`trainer.preference.reference_store`), and the training step
reads them (:func:`reference_logps_for`) instead of loading the reference model. ``precompute: false`` computes
the same values every step with :func:`trainer.preference.pair_batch.pair_logps` under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import torch
from torch import nn

from core.rundir import RunPaths
from trainer.preference.dpo_loss import PairLogps
from trainer.preference.pair_batch import PairBatch, pair_logps
from trainer.preference.reference_store import PairKey, reference_table, stored_logps, write_reference_logps


@torch.no_grad()
def compute_reference_logps(model: nn.Module, batches: Iterable[PairBatch]) -> PairLogps:
    """The reference model's summed log-probs of every pair of ``batches``, in order (eval mode: no dropout)."""
    was_training = model.training
    model.eval()
    try:
        computed = [pair_logps(model, batch) for batch in batches]
    finally:
        model.train(was_training)
    return PairLogps(torch.cat([logps.chosen for logps in computed]).cpu(),
                     torch.cat([logps.rejected for logps in computed]).cpu())


def store_reference_logps(paths: RunPaths, path: Path, keys: Sequence[PairKey], logps: PairLogps,
                          reference_sha256: str) -> None:
    """Write ``logps`` of the pairs ``keys`` (same order) to ``path`` in the run dir, atomically."""
    table = reference_table(keys, logps.chosen.float().numpy(), logps.rejected.float().numpy(), reference_sha256)
    write_reference_logps(paths, path, table)


def reference_logps_for(table: pa.Table, keys: Sequence[PairKey]) -> PairLogps:
    """The stored log-probs of ``keys`` (a checked table of :func:`reference_store.read_reference_logps`), in
    their order, as the loss takes them."""
    chosen, rejected = stored_logps(table, keys)
    return PairLogps(torch.from_numpy(chosen.copy()), torch.from_numpy(rejected.copy()))
