"""Evaluation: validation shards -> val loss and perplexity on a fixed subset (in the loop) or the whole split.

In the training loop the subset is ``eval_batches * micro_batch_size`` val rows (never shuffled): quick, and
comparable across steps and runs, but a subset (its ``val_rows`` / ``val_tokens`` say how much; the full evaluation,
:mod:`trainer.eval.checkpoint`, scores every row, in bits per byte too). It is shared equally among the sources
(each source's first rows in index order; a source with fewer rows gives all it has), so every source is scored: the
result has ``val_loss/<source>`` beside the overall ``val_loss`` (a replay mixture shows whether each source is
learned). In supervised fine-tuning (``loss_masks`` given: the chat shards' ``loss_mask``) only the tokens the
run trains on are scored, the assistant's under ``chat.loss: assistant``, so the numbers are the loss of the
replies, not of the prompts. Each data-parallel replica scores a contiguous share; the summed token losses and
token counts per source are gathered, so the result is the token-weighted mean over the whole subset whatever the
number of processes. Under FSDP every forward all-gathers parameters, so there a rank with a smaller share runs (and
discards) extra forwards until every rank has run as many as the largest share needs. Under tensor parallelism the
processes of a TP group are one replica: they score the same rows together, and only the group's first process
counts them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn

from trainer.loader.batches import Batch, TokenRows, make_batch
from trainer.loader.sft_loss import sft_batch
from trainer.model.llama import IGNORE_INDEX, next_token_loss
from trainer.model.spec import output_logits
from trainer.parallel.accelerator import data_parallel_coordinates, is_sharded, tensor_parallel_rank


class Evaluator:
    """Scores a model on this rank's share of the fixed validation subset."""

    def __init__(self, rows: TokenRows | None, micro_batch_size: int, eval_batches: int | None,
                 accelerator: Accelerator,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                 byte_counter: Callable[[np.ndarray], np.ndarray] | None = None,
                 document_masking: bool = False,
                 loss_masks: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """``eval_batches``: the subset's size in micro-batches; None scores every row.

        ``autocast``: the training precision's autocast context (MixedPrecision.autocast). ``byte_counter``:
        [rows, seq_len] labels -> each row's UTF-8 bytes of its scored tokens (see
        :func:`tokenization.special_tokens.scored_bytes`); with it the result has bits per byte.
        ``document_masking``: score with attention within documents, as ``train.document_masking`` trains.
        ``loss_masks``: row numbers -> their [rows, seq_len] loss masks (supervised fine-tuning,
        :class:`trainer.eval.loss_masks.SplitLossMasks`): only tokens whose mask is 1 are scored, as they are trained.
        """
        self.rows, self.micro_batch_size, self.accelerator = rows, micro_batch_size, accelerator
        self.document_masking, self.loss_masks = document_masking, loss_masks
        self.autocast, self.byte_counter = autocast, byte_counter
        self.split_rows = 0 if rows is None else rows.num_rows
        num_rows = self.split_rows if eval_batches is None else eval_batches * micro_batch_size
        self.sources, subset, subset_sources = fixed_subset(rows, num_rows)
        self.num_rows = len(subset)
        num_replicas, replica = data_parallel_coordinates(accelerator)
        shares = np.array_split(np.arange(self.num_rows, dtype=np.int64), num_replicas)
        self.rank_rows, self.rank_sources = subset[shares[replica]], subset_sources[shares[replica]]
        self.reports_totals = tensor_parallel_rank(accelerator) == 0  # one process per TP group reports
        # array_split puts the larger shares first: shares[0] is the largest.
        share = len(shares[0]) if is_sharded(accelerator) else len(self.rank_rows)
        self.num_forwards = -(-share // micro_batch_size)

    def evaluate(self, model: nn.Module,
                 on_progress: Callable[[int, int], None] | None = None) -> dict[str, float] | None:
        """The scores over the subset (None: no val rows); ``on_progress(rows scored, rows)`` after each forward.

        The rows scored are counted from this process's forwards (every replica runs about as many), so they are
        an estimate until the last call, which reports every row.

        ``val_loss``, ``val_ppl``, ``val_tokens``, ``val_rows`` (scored) and ``val_split_rows`` (in the split),
        ``val_loss/<source>`` with several sources; with a byte counter also ``val_bytes``, ``val_bpb`` and
        ``val_bpb/<source>`` (total nats / ln 2 over the UTF-8 bytes the scored tokens decode to).

        Runs on the unwrapped module: a DDP forward may broadcast buffers, and ranks can hold a
        different number of val batches, so only the final gather is collective (and, under FSDP,
        every forward, which is why ranks then run the same number of them; under TP every forward
        within a TP group, whose processes score the same rows).
        """
        if self.num_rows == 0:
            return None
        module = self.accelerator.unwrap_model(model)
        was_training = module.training
        module.eval()
        # Per source: (summed token loss, tokens, bytes); the same shape on every rank, so one gather sums them.
        totals = torch.zeros(len(self.sources), 3, dtype=torch.float64, device=self.accelerator.device)
        with torch.no_grad(), self.autocast():
            for start in range(0, self.num_forwards * self.micro_batch_size, self.micro_batch_size):
                row_ids = self.rank_rows[start:start + self.micro_batch_size]
                if len(row_ids):
                    sources = torch.from_numpy(self.rank_sources[start:start + self.micro_batch_size])
                    totals.index_add_(0, sources.to(totals.device), self._score(module, row_ids))
                else:  # FSDP lockstep: take part in the all-gathers, count nothing
                    self._score(module, np.zeros(1, dtype=np.int64))
                if on_progress is not None:
                    done = (start // self.micro_batch_size + 1) / self.num_forwards
                    on_progress(min(self.num_rows, round(done * self.num_rows)), self.num_rows)
        module.train(was_training)
        if not self.reports_totals:
            totals.zero_()
        per_source = self.accelerator.gather(totals[None]).sum(dim=0)
        loss_sum, num_tokens, num_bytes = per_source.sum(dim=0).tolist()
        val_loss = loss_sum / max(num_tokens, 1.0)
        result = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": int(num_tokens),
                  "val_rows": self.num_rows, "val_split_rows": self.split_rows}
        if self.byte_counter is not None:
            result.update(val_bytes=int(num_bytes), val_bpb=bits_per_byte(loss_sum, num_bytes))
        if len(self.sources) > 1:
            for source, (source_loss, source_tokens, source_bytes) in zip(self.sources, per_source.tolist(),
                                                                          strict=True):
                result[f"val_loss/{source}"] = source_loss / max(source_tokens, 1.0)
                if self.byte_counter is not None:
                    result[f"val_bpb/{source}"] = bits_per_byte(source_loss, source_bytes)
        return result

    def _score(self, module: nn.Module, row_ids: np.ndarray) -> torch.Tensor:
        """[rows, 3]: each row's summed token loss, its number of scored tokens and their bytes (0 uncounted)."""
        batch = self._batch(row_ids)
        labels = batch.labels.to(self.accelerator.device)
        logits = output_logits(module(**batch.model_kwargs(self.accelerator.device)))
        token_losses = next_token_loss(logits, labels, reduction="none")
        loss_sums = token_losses.view(len(row_ids), -1).double().sum(dim=1)  # ignored labels add 0
        num_tokens = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        num_bytes = torch.zeros_like(loss_sums)
        if self.byte_counter is not None:
            num_bytes = torch.from_numpy(self.byte_counter(batch.labels.numpy())).to(loss_sums)
        return torch.stack([loss_sums, num_tokens.double(), num_bytes], dim=1)

    def _batch(self, row_ids: np.ndarray) -> Batch:
        """The rows as the run trains on them: labels at every token but padding, or at the trained tokens only."""
        doc_starts = self.rows.doc_starts(row_ids) if self.document_masking else None
        if self.loss_masks is not None:
            return sft_batch(self.rows.rows(row_ids), self.loss_masks(row_ids), doc_starts)
        return make_batch(self.rows.rows(row_ids), self.rows.pad_id, self.rows.pad_is_eos, doc_starts)


def bits_per_byte(loss_sum_nats: float, num_bytes: float) -> float:
    """Summed token loss (nats) over the bytes it predicted, in bits: comparable across tokenizers (nan: no bytes)."""
    return loss_sum_nats / math.log(2) / num_bytes if num_bytes > 0 else float("nan")


def fixed_subset(rows: TokenRows | None, num_rows: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(source names, row numbers, each row's source index): up to ``num_rows`` val rows shared among sources.

    Each source gets an equal share of its first rows (the remainder to the first sources in name order); a
    source with fewer rows gives all it has and the others fill in. Rows without sources are one source ``""``.
    """
    if rows is None:
        return [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    by_source = rows.rows_by_source() if hasattr(rows, "rows_by_source") else {"": np.arange(rows.num_rows)}
    names = sorted(by_source)
    quota = dict.fromkeys(names, 0)
    remaining = min(num_rows, sum(len(by_source[name]) for name in names))
    while remaining:  # round-robin over the sources with rows left: equal shares, the rest to the others
        for name in names:
            if remaining and quota[name] < len(by_source[name]):
                quota[name] += 1
                remaining -= 1
    chosen = [by_source[name][:quota[name]] for name in names]
    sources = [np.full(len(part), number, dtype=np.int64) for number, part in enumerate(chosen)]
    return names, np.concatenate(chosen).astype(np.int64), np.concatenate(sources)
