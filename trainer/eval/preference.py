"""A DPO run's checkpoint -> every pair's summed log-probs under it, and the val pairs' DPO loss and rewards.

``python -m trainer.eval.checkpoint --pairs`` (the ``evaluate-pairs`` stage, :mod:`trainer.eval.preference_stage`)
restores a checkpoint and calls :func:`score_preference_pairs`: every row of both splits' preference shards goes
through :func:`trainer.preference.shard_rows.rows_pair_batch` and :func:`trainer.preference.pair_batch.pair_logps`
(no gradients, eval mode: the values the training step and the reference stage compute for the same pair), each
data-parallel replica a contiguous share of the rows, gathered in row order. The main process writes
``eval/results/step-N/preference_logps.parquet`` (:data:`core.eval_results.PREFERENCE_SCORES_SCHEMA`; the
``preference_pairs`` view joins it to the reference's values) and the checkpoint's ``preference`` result: the val
pairs' loss (the recipe's ``train.dpo``: sigmoid DPO against the stored reference log-probs, or SimPO),
``rewards/chosen|rejected|accuracy|margin`` and the mean ``logps/chosen|rejected``, overall and per source, so
``eval_results`` and the report show them beside the training's own ``rewards/*``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import torch
from accelerate import Accelerator
from torch import nn

from core.errors import ConfigError, ShardFormatError
from core.eval_results import PREFERENCE_SCORES_SCHEMA, PREFERENCE_TASK, describe, write_result
from core.progress_lines import ProgressPrinter
from core.rundir import RunPaths
from core.shards.check import checked_shard_path
from core.shards.preference import PREFERENCE_RECORDS, RECORDS_KEY, row_pairs
from core.shards.store import read_shard_index
from trainer.parallel.accelerator import data_parallel_coordinates, is_sharded
from trainer.preference.dpo_loss import PairLogps, PreferenceLoss, dpo_loss, mean_logps, simpo_loss
from trainer.preference.pair_batch import num_loss_tokens, pair_logps
from trainer.preference.shard_rows import rows_pair_batch

LINEAGE = ("doc_ids", "doc_starts", "num_tokens")
VALUES = 4
"""Per pair: chosen log-prob, rejected log-prob, chosen loss tokens, rejected loss tokens."""


@dataclass(frozen=True)
class PairRows:
    """Every row of a run's preference shards (both splits, index order) and the pairs each holds."""

    tokens: list[np.ndarray]
    """Each shard's ``input_ids`` [rows, seq_len] (memory-mapped, no copy)."""
    masks: list[np.ndarray]
    """Each shard's ``loss_mask`` [rows, seq_len]."""
    labels: list[tuple[str, str]]
    """(split, source) of each shard."""
    items: list[tuple[int, int]]
    """(shard, row) of every row, in order."""
    lineage: list[tuple[list[int], list[int], int]]
    """Each row's ``doc_ids``, ``doc_starts`` and ``num_tokens``."""
    pair_doc_ids: list[list[int]]
    """Each row's pairs' doc ids, in row order (the order :func:`rows_pair_batch` gives their values)."""


def read_pair_rows(paths: RunPaths) -> PairRows:
    """The run's preference shards as the index lists them, each checked against its sha256; ConfigError naming a
    shard that is not a preference shard (a DPO run trains on pairs only), ShardFormatError for a damaged one."""
    rows = PairRows([], [], [], [], [], [])
    for info in read_shard_index(paths.root):
        path = checked_shard_path(paths.root, info)
        reader = ipc.open_file(pa.memory_map(str(path)))
        if (reader.schema.metadata or {}).get(RECORDS_KEY.encode()) != PREFERENCE_RECORDS.encode():
            raise ConfigError(f"{path}: not a preference shard (no `{RECORDS_KEY}: {PREFERENCE_RECORDS}` in its "
                              "metadata); a DPO run scores pairs only: prepare it from `records: preference` "
                              "sources in a fresh run dir.")
        table = reader.read_all()
        seq_len = table.schema.field("input_ids").type.list_size
        for name, arrays in (("input_ids", rows.tokens), ("loss_mask", rows.masks)):
            values = table.column(name).combine_chunks().values.to_numpy(zero_copy_only=False)
            arrays.append(values.reshape(-1, seq_len))
        for row, lineage in enumerate(zip(*(table.column(name).to_pylist() for name in LINEAGE), strict=True)):
            try:
                rows.pair_doc_ids.append([pair.doc_id for pair in row_pairs(*lineage)])
            except ValueError as err:
                raise ShardFormatError(f"{path}: row {row}: {err}; re-run `tokenmill prepare`.") from None
            rows.items.append((len(rows.labels), row))
            rows.lineage.append(lineage)
        rows.labels.append((info.split, info.source))
    return rows


class PairScorer:
    """Scores this replica's share of the rows; :meth:`score` returns every pair's values on the main process."""

    def __init__(self, rows: PairRows, micro_batch_size: int, accelerator: Accelerator,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.rows, self.micro_batch_size, self.accelerator = rows, micro_batch_size, accelerator
        self.autocast = autocast
        self.num_replicas, replica = data_parallel_coordinates(accelerator)
        self.shares = np.array_split(np.arange(len(rows.items)), self.num_replicas)
        self.share = self.shares[replica]
        self.share_pairs = [sum(len(rows.pair_doc_ids[item]) for item in share) for share in self.shares]
        longest = len(self.shares[0]) if is_sharded(accelerator) else len(self.share)  # array_split: largest first
        self.num_forwards = -(-longest // micro_batch_size)

    @torch.no_grad()
    def score(self, model: nn.Module, on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """float64 [pairs, VALUES] of every pair in row order (on every process; only the main one writes).

        Runs on the unwrapped module in eval mode; under FSDP a replica with a shorter share runs (and discards)
        forwards until every rank has run as many, as :class:`trainer.eval.evaluate.Evaluator` does. The rows
        done are estimated from this process's forwards, every row at the last one."""
        module = self.accelerator.unwrap_model(model)
        was_training = module.training
        module.eval()
        values = torch.zeros(max(self.share_pairs, default=0), VALUES, dtype=torch.float64)
        filler = self.share[:1] if len(self.share) else np.zeros(1, dtype=np.int64)  # FSDP lockstep only
        filled, total = 0, len(self.rows.items)
        try:
            with self.autocast():
                for forward in range(self.num_forwards):
                    items = self.share[forward * self.micro_batch_size:(forward + 1) * self.micro_batch_size]
                    scored = self._score(module, items if len(items) else filler)
                    if len(items):
                        values[filled:filled + len(scored)] = scored
                        filled += len(scored)
                    if on_progress is not None:
                        on_progress(min(total, round((forward + 1) / self.num_forwards * total)), total)
        finally:
            module.train(was_training)
        return self._gathered(values)

    def _score(self, module: nn.Module, items: np.ndarray) -> torch.Tensor:
        """[pairs of these rows, VALUES]: their pairs' log-probs and loss tokens, in row order."""
        rows = self.rows
        picked = [rows.items[int(item)] for item in items]
        lineage = [rows.lineage[int(item)] for item in items]
        batch, _ = rows_pair_batch(np.stack([rows.tokens[shard][row] for shard, row in picked]),
                                   np.stack([rows.masks[shard][row] for shard, row in picked]),
                                   *(list(column) for column in zip(*lineage, strict=True)))
        batch = batch.to(self.accelerator.device)
        logps, tokens = pair_logps(module, batch), num_loss_tokens(batch)
        return torch.stack([logps.chosen, logps.rejected, tokens.chosen, tokens.rejected], dim=1).double().cpu()

    def _gathered(self, values: torch.Tensor) -> np.ndarray:
        """Every replica's values, in replica order (one process per tensor-parallel group counts)."""
        gathered = self.accelerator.gather(values.to(self.accelerator.device)[None]).cpu()
        per_process = gathered.reshape(self.accelerator.num_processes, -1, VALUES)
        group = self.accelerator.num_processes // self.num_replicas  # consecutive ranks form a TP group
        parts = [per_process[replica * group, :count] for replica, count in enumerate(self.share_pairs)]
        return torch.cat(parts).numpy() if parts else np.zeros((0, VALUES))


def scores_table(rows: PairRows, step: int, values: np.ndarray) -> pa.Table:
    """The rows of :data:`core.eval_results.PREFERENCE_SCORES_SCHEMA` for every pair of ``rows`` (``values`` in
    row order, as :meth:`PairScorer.score` returns them)."""
    splits, sources, doc_ids = [], [], []
    for (shard, _), pairs in zip(rows.items, rows.pair_doc_ids, strict=True):
        split, source = rows.labels[shard]
        splits.extend([split] * len(pairs))
        sources.extend([source] * len(pairs))
        doc_ids.extend(pairs)
    return pa.Table.from_pydict({
        "step": [step] * len(doc_ids), "split": splits, "source": sources, "doc_id": doc_ids,
        "chosen_logp": values[:, 0].astype(np.float32), "rejected_logp": values[:, 1].astype(np.float32),
        "chosen_tokens": values[:, 2].astype(np.int32), "rejected_tokens": values[:, 3].astype(np.int32),
    }, schema=PREFERENCE_SCORES_SCHEMA)


def write_scores(paths: RunPaths, step: int, table: pa.Table) -> Path:
    """``eval/results/step-N/preference_logps.parquet``, written atomically."""
    path = paths.preference_scores(step)
    with paths.atomic_write(path, size_hint_bytes=table.nbytes) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


def reference_values(paths: RunPaths, split: str, source: str) -> dict[int, tuple[float, float]] | None:
    """``{doc_id: (chosen, rejected)}`` of the reference stage's file of (split, source); None when there is none
    (``precompute: false``, or a reference-free loss). ShardFormatError naming a file without those columns."""
    path = paths.reference_logps(split, source)
    if not path.is_file():
        return None
    try:
        table = pq.read_table(path, columns=["doc_id", "chosen_logp", "rejected_logp"])
    except (OSError, pa.ArrowException, KeyError) as err:
        raise ShardFormatError(f"{path}: not readable as reference log-probs ({err}); re-run the reference "
                               "stage (`tokenmill train`).") from None
    columns = [table.column(name).to_pylist() for name in table.column_names]
    return {int(doc_id): (float(chosen), float(rejected)) for doc_id, chosen, rejected in zip(*columns, strict=True)}


def score_preference_pairs(model: nn.Module, paths: RunPaths, micro_batch_size: int, accelerator: Accelerator,
                           step: int, fingerprints: tuple[str, str], settings: dict[str, Any],
                           autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                           ) -> None:
    """Score every pair under ``model`` (each process a share) and, on the main process, write the scores and the
    ``preference`` result (``fingerprints``: the checkpoint's and the task's; ``settings``:
    :func:`trainer.eval.run_mode.dpo_settings`), printing progress lines meanwhile and the result's line last."""
    rows = read_pair_rows(paths)
    printer = ProgressPrinter("rows") if accelerator.is_main_process else None
    values = PairScorer(rows, micro_batch_size, accelerator, autocast).score(model, printer)
    if not accelerator.is_main_process:
        return
    table = scores_table(rows, step, values)
    write_scores(paths, step, table)
    try:
        result_rows = val_result_rows(paths, table, settings)
        error = None if result_rows else (f"{paths.shard_index}: no split=val preference shards to score; set "
                                          "data.val_fraction above 0 and re-run `tokenmill prepare` in a fresh "
                                          "run dir.")
    except ShardFormatError as err:
        result_rows, error = [], str(err)
    print(describe(write_result(paths, step, PREFERENCE_TASK, *fingerprints, rows=result_rows, error=error)),
          flush=True)


def val_result_rows(paths: RunPaths, table: pa.Table, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``preference`` result's rows: the val pairs' loss and rewards (and mean log-probs), over every source
    (``source`` None) and per source; no loss or rewards for sigmoid DPO without stored reference values
    (``precompute: false``). ShardFormatError when a reference file lacks a val pair (it is stale)."""
    val = table.filter(pc.equal(table.column("split"), "val")).to_pydict()
    by_source: dict[str | None, list[int]] = {None: list(range(len(val["doc_id"])))}
    for index, source in enumerate(val["source"]):
        by_source.setdefault(source, []).append(index)
    if not by_source[None]:
        return []
    references = _val_references(paths, val, sorted(name for name in by_source if name is not None), settings)
    rows = []
    for source, indices in by_source.items():
        policy = PairLogps(*(torch.tensor([val[f"{side}_logp"][i] for i in indices]) for side in SIDES))
        metrics = {"logps/chosen": policy.chosen.mean().item(), "logps/rejected": policy.rejected.mean().item()}
        loss = _loss(policy, [val[f"{side}_tokens"][i] for side in SIDES for i in indices],
                     None if references is None else [references[i] for i in indices], settings)
        if loss is not None:
            metrics = {"loss": loss.loss.item(), **loss.metrics(), **metrics}
        rows.extend({"metric": name, "value": value, "stderr": None, "num_samples": len(indices), "source": source}
                    for name, value in metrics.items())
    return rows


SIDES = ("chosen", "rejected")


def _val_references(paths: RunPaths, val: dict[str, list[Any]], sources: list[str],
                    settings: dict[str, Any]) -> list[tuple[float, float]] | None:
    """Each val pair's stored reference (chosen, rejected), in ``val``'s order; None when the loss needs none or
    a source has no reference file."""
    if settings["loss"] == "simpo":
        return None
    stored = {source: reference_values(paths, "val", source) for source in sources}
    if any(values is None for values in stored.values()):
        return None
    found = []
    for source, doc_id in zip(val["source"], val["doc_id"], strict=True):
        values = stored[source]
        if values is None or doc_id not in values:
            raise ShardFormatError(f"{paths.reference_logps('val', source)}: no reference log-probs for pair "
                                   f"{doc_id}; the file is stale: re-run the reference stage (`tokenmill train`).")
        found.append(values[doc_id])
    return found


def _loss(policy: PairLogps, tokens: list[int], reference: list[tuple[float, float]] | None,
          settings: dict[str, Any]) -> PreferenceLoss | None:
    """The recipe's loss of these pairs (``tokens``: chosen sides' loss tokens, then rejected sides')."""
    if settings["loss"] == "simpo":
        counts = torch.tensor(tokens, dtype=torch.float32).reshape(2, -1)
        return simpo_loss(mean_logps(policy, PairLogps(counts[0], counts[1])), settings["beta"],
                          settings["simpo_gamma"], settings["label_smoothing"])
    if reference is None:
        return None
    values = torch.tensor(reference, dtype=torch.float32).reshape(-1, 2)
    return dpo_loss(policy, PairLogps(values[:, 0], values[:, 1]), settings["beta"], settings["label_smoothing"])
