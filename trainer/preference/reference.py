"""Reference log-probs: the reference model's summed log-probs of each pair's sides, computed once, then read back.

DPO needs ``ref_c`` and ``ref_r`` for every pair; they depend only on the reference model's weights and the pair's
tokens, so a stage computes them once (:func:`compute_reference_logps`) and stores them per pair
(:func:`store_reference_logps`, the file of :mod:`trainer.preference.reference_store`), and the training step
reads them (:func:`reference_logps_for`) instead of loading the reference model. ``precompute: false`` computes
the same values every step with :func:`trainer.preference.pair_batch.pair_logps` under ``torch.no_grad()``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from core.rundir import RunPaths
from core.stage import Progress
from tokenization.special_tokens import read_special_tokens
from trainer.config import ModelConfig
from trainer.loader.batches import SplitRows
from trainer.loader.pair_rows import PairRows
from trainer.model.spec import model_spec
from trainer.precision import MixedPrecision
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


ROWS_PER_BATCH = 8
"""Shard rows per reference forward (several pairs each)."""

_ONE_UNIT_AT_A_TIME = threading.Lock()
"""The flow runs a stage's units on its thread pool: the units take turns (torch already uses every core within one
forward), so one copy of the reference model is in memory at a time, not one per unit."""


def compute_unit_reference(paths: RunPaths, model_config: ModelConfig, split: str, source: str,
                           reference_sha256: str, on_progress: Progress, precision: str = "fp32") -> dict[str, Any]:
    """The reference stage's work for one (split, source): the base model's log-probs of every pair of its indexed
    preference shards, under ``precision``'s autocast (the policy's), on the GPU when there is one (else the CPU),
    written to ``paths.reference_logps(split, source)``; returns the summary."""
    special = read_special_tokens(paths)
    rows = SplitRows(paths.root, split, special.pad_id, special.pad_is_eos, mode="dpo", source=source)
    try:
        with _ONE_UNIT_AT_A_TIME:
            pairs = PairRows(rows)
            spec = model_spec(model_config, paths, rows.vocab_size, rows.seq_len, special.eos_id, special.pad_id)
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = spec.build(0).to(device)  # the base model's weights (from_pretrained); the seed draws nothing
            keys: list[PairKey] = []

            def batches() -> Iterator[PairBatch]:
                for start in range(0, rows.num_rows, ROWS_PER_BATCH):
                    micro = pairs.micro_batch(np.arange(start, min(start + ROWS_PER_BATCH, rows.num_rows)))
                    keys.extend(micro.keys)
                    yield micro.batch.to(device)
                    on_progress(len(keys), None)

            with MixedPrecision(precision, device.type).autocast():
                logps = compute_reference_logps(model, batches())
            del model  # freed before the next unit loads its copy
    finally:
        rows.close()
    store_reference_logps(paths, paths.reference_logps(split, source), keys, logps, reference_sha256)
    return {"num_pairs": len(keys), "num_rows": rows.num_rows, "reference_sha256": reference_sha256}

