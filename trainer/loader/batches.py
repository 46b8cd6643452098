"""Loader: Arrow token shards (``shards/index.parquet``) -> int64 training batches, in a resumable global order.

The order is a pure function of (seed, epoch): all train rows across shards are numbered in index
order, and epoch ``e`` visits them in ``np.random.default_rng([seed, e]).permutation(num_rows)``.
Global sample ``k`` is row ``perm_{k // N}[k % N]``. Each optimizer step consumes one global batch
(``micro_batch_size * grad_accum_steps * world_size`` samples) and rank ``r`` takes the ``r``-th
contiguous slice of it, so the loader position is one integer (``samples_consumed``): resuming is
O(1), and a position saved by 2 processes continues on 1 process (with grad_accum doubled) through
the very same micro-batches. With per-source mixture weights (``trainer.loader.mixture``) the global
sample sequence interleaves the sources by weight instead, with the same rank slicing.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from core.errors import CheckpointError, ShardFormatError
from core.shards.check import open_checked_shards
from core.shards.store import ShardInfo, read_shard_index
from trainer.config import TrainMode
from trainer.loader.chat_rows import LossMasks, check_shards_fit_mode
from trainer.loader.document_mask import ShardDocStarts, position_ids
from trainer.loader.mixture import MixtureOrder
from trainer.model.llama import IGNORE_INDEX


class PairSource(Protocol):
    """What the loader needs of a split's pairs (:class:`trainer.loader.pair_rows.PairRows`, which reads this
    module's :class:`SplitRows`: named by this protocol, not imported, so the two modules do not import each other)."""

    def num_pairs(self, row_ids: np.ndarray) -> int:
        """Whole pairs in rows ``row_ids``."""
        ...

    def micro_batch(self, row_ids: np.ndarray) -> Any:
        """Rows ``row_ids`` as one batch of pairs (a :class:`trainer.loader.pair_rows.PairMicroBatch`)."""
        ...

EOS_ID = 0
"""``<|endoftext|>`` (ends every document in a packed row) in a tokenizer tokenmill trained. Pack looks the
special ids up by name, so a loaded tokenizer may have others: the trainer takes them from the run's tokenizer."""

PAD_ID = 1
"""``<|pad|>`` (fills the end of a source's last row; its labels become IGNORE_INDEX) in a trained tokenizer."""

LOADER_STATE_VERSION = 1

YIELDED_ROWS_HOOK = "TOKENMILL_TEST_YIELDED_ROWS"
"""Test hook, never set in production: a path prefix; each rank's loader appends the rows it yields to
``<prefix>-rank<R>.jsonl`` (``{"sample", "rank", "world_size", "micro_batch_size", "rows"}`` per step), so a test
can check the ``consumed`` view against what was actually loaded. Training never reads it back."""


class TokenRows(Protocol):
    """Random access to fixed-length token rows (shards on disk, or an array in a benchmark)."""

    num_rows: int
    seq_len: int
    pad_id: int
    """The padding token's id: its labels are IGNORE_INDEX."""
    pad_is_eos: bool
    """Padding is the EOS id (a model tokenizer with no pad token): only each row's trailing EOS run is padding."""
    digests: dict[str, str]
    """What the rows come from, {name: sha256}: a checkpoint resumes only on the same (or appended) data."""

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows ``indices`` as a [len(indices), seq_len] integer array."""
        ...

    def doc_starts(self, indices: np.ndarray) -> list[np.ndarray]:
        """Where each document begins in each of rows ``indices`` (token offsets, the first 0): document masking."""
        ...

    def loss_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """Rows ``indices``' loss masks [len(indices), seq_len] (1: a target) for SFT; None: every token but padding."""
        ...


class ArrayRows:
    """TokenRows over an in-memory [num_rows, seq_len] array (benchmarks and small experiments)."""

    def __init__(self, tokens: np.ndarray, pad_id: int = PAD_ID, pad_is_eos: bool = False,
                 doc_starts: list[np.ndarray] | None = None, loss_mask: np.ndarray | None = None) -> None:
        """``doc_starts``: each row's document starts (as a shard's column); None = one document per row.
        ``loss_mask``: [num_rows, seq_len] targets of SFT rows (as a chat shard's column); None = pretraining."""
        self.tokens, self.pad_id, self.pad_is_eos = tokens, pad_id, pad_is_eos
        self._doc_starts, self._loss_mask = doc_starts, loss_mask
        self.num_rows, self.seq_len = (int(n) for n in tokens.shape)
        self.digests = {"array": hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()}

    def rows(self, indices: np.ndarray) -> np.ndarray:
        return self.tokens[indices]

    def doc_starts(self, indices: np.ndarray) -> list[np.ndarray]:
        if self._doc_starts is None:
            return [np.zeros(1, dtype=np.int64) for _ in indices]
        return [np.asarray(self._doc_starts[int(i)], dtype=np.int64) for i in indices]

    def loss_mask(self, indices: np.ndarray) -> np.ndarray | None:
        return None if self._loss_mask is None else self._loss_mask[indices]


class ShardNumbering:
    """Global row numbers over a list of shards (in index order): row ``k`` is row ``k - starts[i]`` of shard ``i``.

    The loader orders these numbers; the ``consumed`` view (:mod:`trainer.metrics.consumed`) maps them back to
    (shard_path, row_in_shard) with the very same numbering, from a launch's recorded shard list.
    """

    def __init__(self, shard_paths: list[str], shard_sources: list[str], shard_num_rows: list[int],
                 digests: dict[str, str]) -> None:
        self.shard_paths, self.shard_sources, self.digests = list(shard_paths), list(shard_sources), dict(digests)
        sizes = np.asarray(shard_num_rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, row in that shard) of each global row number in ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        shard_ids = np.searchsorted(self.starts, indices, side="right") - 1
        return shard_ids, indices - self.starts[shard_ids]

    def rows_by_source(self) -> dict[str, np.ndarray]:
        """Global row numbers of each source's rows (for mixture weights)."""
        by_source: dict[str, list[np.ndarray]] = {}
        for number, source in enumerate(self.shard_sources):
            by_source.setdefault(source, []).append(np.arange(self.starts[number], self.starts[number + 1]))
        return {source: np.concatenate(parts) for source, parts in by_source.items()}


class SplitRows(ShardNumbering):
    """TokenRows over every shard of one split, numbered in index order; memory-mapped, zero-copy."""

    def __init__(self, run_dir: Path, split: str, pad_id: int, pad_is_eos: bool = False,
                 mode: TrainMode | None = None, source: str | None = None) -> None:
        """``pad_id``: the padding id of the tokenizer the shards were packed with; ``pad_is_eos``: it is also the
        EOS id (see :func:`make_batch`). Both come from :func:`tokenization.special_tokens.read_special_tokens`.
        ``mode``: what the rows are read for (``train.mode``): ``sft`` reads the chat shards' loss masks, and every
        shard must fit the mode (ConfigError naming the first that does not); None reads tokens only, any shard.
        ``sft`` and ``dpo`` read the shards' loss masks. ``source``: only that source's shards (None: every source).

        Raises ShardFormatError (from :func:`core.shards.store.read_shard_index`) when an index row names a path
        that is absolute, holds ``..`` or resolves outside the run dir: nothing outside the run dir is trained on;
        and (:func:`core.shards.check.open_checked_shards`) when a shard's bytes differ from the index's sha256:
        each shard is hashed once per process (or not at all when its digest is cached), never per batch.
        """
        infos = [info for info in read_shard_index(Path(run_dir))
                 if info.split == split and source in (None, info.source)]
        self.split, self.pad_id, self.pad_is_eos = split, pad_id, pad_is_eos
        self.tokenizer_sha256 = {info.tokenizer_sha256 for info in infos}
        self.shards = open_checked_shards(Path(run_dir), infos)
        self.seq_len = _common_value(infos, [int(s.metadata["seq_len"]) for s in self.shards], "seq_len")
        self.vocab_size = _common_value(infos, [int(s.metadata["vocab_size"]) for s in self.shards], "vocab_size")
        super().__init__([info.path for info in infos], [info.source for info in infos],
                         [len(shard) for shard in self.shards], {info.path: info.sha256 for info in infos})
        self._doc_starts: dict[int, ShardDocStarts] = {}  # opened on first use: only document masking reads them
        if mode is not None:
            check_shards_fit_mode([shard.path for shard in self.shards], mode)
        self.mode = mode
        masked = mode in ("sft", "dpo")
        self._loss_masks = LossMasks([shard.path for shard in self.shards], self.seq_len) if masked else None

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows copied straight from the memory maps into one int64 array (the only copy).

        A plain loop over rows: for a batch's few rows it beats per-shard fancy indexing (measured 9 vs
        24 us for 16 rows over 8 shards), because NumPy's per-call overhead dominates such small gathers.
        """
        indices = np.asarray(indices, dtype=np.int64)
        shard_ids = np.searchsorted(self.starts, indices, side="right") - 1
        local_rows = (indices - self.starts[shard_ids]).tolist()
        out = np.empty((len(indices), self.seq_len), dtype=np.int64)
        for i, (shard_id, row) in enumerate(zip(shard_ids.tolist(), local_rows, strict=True)):
            out[i] = self.shards[shard_id].tokens[row]
        return out

    def doc_starts(self, indices: np.ndarray) -> list[np.ndarray]:
        """Each row's ``doc_starts`` from its shard (a shard's column is read and checked on first use)."""
        indices = np.asarray(indices, dtype=np.int64)
        shard_ids = np.searchsorted(self.starts, indices, side="right") - 1
        out = []
        for shard_id, row in zip(shard_ids.tolist(), (indices - self.starts[shard_ids]).tolist(), strict=True):
            if shard_id not in self._doc_starts:
                shard = self.shards[shard_id]
                self._doc_starts[shard_id] = ShardDocStarts(shard.path, shard.seq_len)
            out.append(self._doc_starts[shard_id].row(row))
        return out

    def loss_mask(self, indices: np.ndarray) -> np.ndarray | None:
        """Each row's ``loss_mask`` from its chat shard (uint8 [len(indices), seq_len]); None unless mode is sft/dpo."""
        if self._loss_masks is None:
            return None
        shard_ids, rows = self.locate(indices)
        return self._loss_masks.rows(shard_ids.tolist(), rows.tolist())

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
        if self._loss_masks is not None:
            self._loss_masks.close()


def _common_value(infos: list[ShardInfo], values: list[int], key: str) -> int | None:
    distinct = sorted(set(values))
    if len(distinct) > 1:
        raise ShardFormatError(
            f"shards disagree on {key} ({distinct}; e.g. {infos[0].path}); every shard of a run must come "
            "from one tokenizer and packing setting: re-run `tokenmill prepare` in a fresh run dir."
        )
    return distinct[0] if distinct else None


@dataclass(frozen=True)
class Batch:
    """One micro-batch: ``input_ids`` and ``labels`` int64 [rows, seq_len]; labels are IGNORE_INDEX at padding.

    Read-only: without padding both fields are the same tensor. ``position_ids`` int64 [rows, seq_len] only with
    document masking: each token's position in its document (see :mod:`trainer.loader.document_mask`).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None

    def model_kwargs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments on ``device``: ``input_ids``, and ``position_ids`` when masking."""
        kwargs = {"input_ids": self.input_ids.to(device)}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids.to(device)
        return kwargs

    @property
    def num_tokens(self) -> int:
        """Tokens that count in the loss (padding excluded)."""
        return int((self.labels != IGNORE_INDEX).sum())


def make_batch(tokens: np.ndarray, pad_id: int, pad_is_eos: bool = False,
               doc_starts: list[np.ndarray] | None = None, loss_mask: np.ndarray | None = None) -> Batch:
    """Wrap integer rows as int64 tensors with padding (``pad_id``) masked in labels.

    ``doc_starts``: each row's document starts (document masking): the batch then carries ``position_ids``.
    ``loss_mask``: SFT rows' targets (:mod:`core.shards.chat`): labels are ``where(loss_mask, tokens, IGNORE_INDEX)``
    and padding is whatever the mask leaves out.

    ``pad_is_eos``: ``pad_id`` is also the EOS that ends every document, so only the EOS after a row's last
    real EOS are padding (pack pads only the end of a source's last row, right after a document's EOS).
    Without padding (almost every batch) ``labels`` is ``input_ids`` itself: no second copy; nothing
    writes to either. Done in NumPy: torch's per-op overhead on these small tensors cost more than the data.
    """
    input_ids = np.asarray(tokens, dtype=np.int64)
    if loss_mask is not None:  # a 0 is a prompt token, padding or a conversation's first token
        labels = np.where(np.asarray(loss_mask) != 0, input_ids, IGNORE_INDEX)
    else:
        is_pad = _trailing_padding(input_ids, pad_id) if pad_is_eos else input_ids == pad_id
        labels = np.where(is_pad, IGNORE_INDEX, input_ids) if is_pad.any() else input_ids
    positions = None if doc_starts is None else torch.from_numpy(position_ids(doc_starts, input_ids.shape[1]))
    return Batch(torch.from_numpy(input_ids), torch.from_numpy(labels), positions)


def load_batch(rows: TokenRows, row_ids: np.ndarray, document_masking: bool = False) -> Batch:
    """Rows ``row_ids`` as one batch: their labels by the rows' loss mask (SFT) or all but padding (pretraining)."""
    doc_starts = rows.doc_starts(row_ids) if document_masking else None
    return make_batch(rows.rows(row_ids), rows.pad_id, rows.pad_is_eos, doc_starts, rows.loss_mask(row_ids))


def _trailing_padding(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """[rows, seq_len] bool: each row's trailing run of ``eos_id`` except its first token (the real EOS)."""
    is_eos = input_ids == eos_id
    if input_ids.shape[1] < 2 or not (is_eos[:, -1] & is_eos[:, -2]).any():
        return np.zeros_like(is_eos)  # a padded row ends in at least two EOS: the real one, then padding
    seq_len = input_ids.shape[1]
    real = ~is_eos
    last_real = seq_len - 1 - np.argmax(real[:, ::-1], axis=1)  # argmax: the first True from the end
    run_start = np.where(real.any(axis=1), last_real + 1, 0)
    return np.arange(seq_len)[None, :] > run_start[:, None]


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's global batch is split: micro-batches per rank, and ranks."""

    micro_batch_size: int
    grad_accum_steps: int
    world_size: int = 1
    rank: int = 0

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size


class TrainLoader:
    """Deterministic, resumable source of micro-batches; ``state_dict()`` is a few JSON integers."""

    def __init__(self, rows: TokenRows, layout: BatchLayout, seed: int, allow_data_change: bool = False,
                 mixture: MixtureOrder | None = None, document_masking: bool = False,
                 pairs: PairSource | None = None) -> None:
        """``allow_data_change``: accept a saved position taken on other shards (an incremental refresh).

        ``mixture``: interleave sources by weight; None = every row equally likely (one permutation per epoch).
        ``document_masking``: batches carry ``position_ids`` from the rows' ``doc_starts`` (the order is unchanged).
        ``pairs``: the preference view of ``rows`` (``train.mode: dpo``): each micro-batch is then a batch of whole
        pairs (:class:`trainer.loader.pair_rows.PairMicroBatch`), in the same order.
        """
        if rows.num_rows == 0:
            raise ShardFormatError("no train rows: the shard index lists no split=train shards; "
                                   "run `tokenmill prepare` (and check data.val_fraction < 1).")
        self.rows, self.layout, self.seed = rows, layout, seed
        self.allow_data_change, self.mixture, self.document_masking = allow_data_change, mixture, document_masking
        self.samples_consumed = 0
        self.step_loss_tokens: int | None = None
        """SFT: the trained tokens of the last step's whole global batch (all ranks), the divisor of its loss."""
        self.pairs = pairs
        self.step_pairs: int | None = None
        """DPO: the pairs of the last step's whole global batch (all ranks), the divisor of its loss."""
        self._epoch_order: tuple[int, np.ndarray] | None = None
        hook = os.environ.get(YIELDED_ROWS_HOOK)
        self._yielded_rows_file = None if not hook else Path(f"{hook}-rank{layout.rank}.jsonl")
        if mixture is not None:
            mixture.warn = layout.rank == 0  # one warning per dropped source, not one per rank

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all row numbers that epoch ``epoch`` visits (cached for the current epoch)."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.rows.num_rows)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def global_rows(self, start: int, count: int) -> np.ndarray:
        """Row numbers of global samples ``start .. start + count - 1`` (crossing epochs as needed)."""
        samples = np.arange(start, start + count, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.rows.num_rows)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.epoch_order(int(epoch))[positions[mask]]
        return out

    def next_steps_rows(self, num_steps: int = 1) -> np.ndarray:
        """Row numbers of the next ``num_steps`` optimizer steps, [num_steps, world_size, micro_batch_size *
        grad_accum_steps]: rank r trains on ``[step, r]``, its micro-batches in order. Advances the position.

        Every rank walks the whole global batch (with a mixture the per-source counts then agree on all ranks).
        This is the one place the order meets the batch layout: :meth:`next_step` loads these rows, and the
        ``consumed`` view (:mod:`trainer.metrics.consumed`) replays a launch through it without reading a token.
        """
        layout = self.layout
        count = num_steps * layout.global_batch_size
        if self.mixture is None:
            rows = self.global_rows(self.samples_consumed, count)
        else:
            rows = self.mixture.take(self.samples_consumed, count, num_steps)
        self.samples_consumed += count
        return rows.reshape(num_steps, layout.world_size, -1)

    def next_step(self) -> list[Batch] | list[Any]:
        """This rank's ``grad_accum_steps`` micro-batches of the next optimizer step; advances the position."""
        layout = self.layout
        per_rank = layout.micro_batch_size * layout.grad_accum_steps
        first_sample = self.samples_consumed
        step_rows = self.next_steps_rows(1)[0]
        row_ids = step_rows[layout.rank]
        if self._yielded_rows_file is not None:
            record_yielded_rows(self._yielded_rows_file, first_sample + layout.rank * per_rank, layout, row_ids)
        if self.pairs is not None:
            self.step_pairs = self.pairs.num_pairs(step_rows.reshape(-1))
            return [self.pairs.micro_batch(row_ids[i:i + layout.micro_batch_size])
                    for i in range(0, per_rank, layout.micro_batch_size)]
        tokens = self.rows.rows(row_ids)
        doc_starts = self.rows.doc_starts(row_ids) if self.document_masking else None
        masks = self.step_loss_masks(step_rows)
        size = layout.micro_batch_size
        return [make_batch(tokens[i:i + size], self.rows.pad_id, self.rows.pad_is_eos,
                           None if doc_starts is None else doc_starts[i:i + size],
                           None if masks is None else masks[i:i + size])
                for i in range(0, per_rank, size)]

    def step_loss_masks(self, step_rows: np.ndarray) -> np.ndarray | None:
        """This rank's loss masks of a step's rows [world_size, rows per rank] (None: pretraining); sets
        ``step_loss_tokens`` from every rank's masks, so the step's divisor needs no collective."""
        masks = self.rows.loss_mask(step_rows.reshape(-1))
        if masks is None:
            self.step_loss_tokens = None
            return None
        self.step_loss_tokens = int(np.count_nonzero(masks[:, 1:]))  # a row's first token is never a target
        per_rank = step_rows.shape[1]
        return masks[self.layout.rank * per_rank:(self.layout.rank + 1) * per_rank]

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed so far."""
        return self.samples_consumed / self.rows.num_rows

    def state_dict(self) -> dict[str, Any]:
        state = {"version": LOADER_STATE_VERSION, "samples_consumed": self.samples_consumed, "seed": self.seed,
                 "num_rows": self.rows.num_rows, "global_batch_size": self.layout.global_batch_size,
                 "shards": dict(sorted(self.rows.digests.items()))}
        if self.mixture is not None:
            state["mixture"] = self.mixture.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses another seed, and changed (not just appended) shards."""
        if state.get("version") != LOADER_STATE_VERSION:
            raise CheckpointError(f"loader state version {state.get('version')!r}, this tokenmill reads "
                                  f"{LOADER_STATE_VERSION}; start a fresh run dir (or delete checkpoints/).")
        if state["seed"] != self.seed:
            raise CheckpointError(f"checkpoint was trained with train.seed={state['seed']}, the recipe says "
                                  f"{self.seed}; restore train.seed or delete checkpoints/ to start over.")
        self._check_same_data(state["shards"], state["num_rows"])
        if state["global_batch_size"] != self.layout.global_batch_size and self.layout.rank == 0:
            warnings.warn(f"global batch changed from {state['global_batch_size']} to "
                          f"{self.layout.global_batch_size} samples per step (micro_batch_size * "
                          "grad_accum_steps * processes); the sample order continues unchanged", stacklevel=2)
        self.samples_consumed = int(state["samples_consumed"])
        self._load_mixture_state(state.get("mixture"), self.samples_consumed // int(state["global_batch_size"]))

    def pop_mix_counts(self) -> list[dict[str, Any]] | None:
        """Samples per (stage, source) since the last call, for the metrics row; None without a mixture."""
        return None if self.mixture is None else self.mixture.pop_window_counts()

    def _load_mixture_state(self, saved: dict[str, Any] | None, steps: int) -> None:
        """``steps``: the optimizer steps taken, for a mixture state saved before they were counted."""
        if self.mixture is None:
            if saved is not None and self.layout.rank == 0:
                warnings.warn("the checkpoint was trained with mixture weights and run.yaml has none now; "
                              "continuing with every row equally likely", stacklevel=3)
            return
        if saved is None:
            if not self.allow_data_change:
                raise CheckpointError("the checkpoint was trained without mixture weights and run.yaml now has a "
                                      "mixture section; pass --allow-data-change to start the weighted order at "
                                      "this step, or remove the mixture section.")
            saved = {"position": self.samples_consumed, "source_samples": {}, "weights": self.mixture.weights}
            if self.mixture.scheduled:
                saved["schedule"] = self.mixture.schedule_state()
        self.mixture.load_state_dict({"step": steps, **saved})

    def _check_same_data(self, saved: dict[str, str], saved_num_rows: int) -> None:
        if saved == self.rows.digests:
            return
        changed = sorted(name for name, digest in saved.items() if self.rows.digests.get(name) != digest)
        if changed and not self.allow_data_change:
            raise CheckpointError(
                f"train shards were changed or removed since the checkpoint (e.g. {changed[0]}); "
                "pass --allow-data-change to continue on the current shards, or delete checkpoints/.")
        # Appended shards (an incremental refresh) are expected: the sample count continues over the new
        # order of all rows, so some rows repeat or are skipped once; the counts say how much changed.
        if self.layout.rank == 0:
            warnings.warn(f"train data changed since the checkpoint ({saved_num_rows} -> {self.rows.num_rows} rows); "
                          "continuing the sample count over the new data order", stacklevel=3)


def record_yielded_rows(path: Path, first_sample: int, layout: BatchLayout, row_ids: np.ndarray) -> None:
    """Append one step's rows to the test hook's file (see YIELDED_ROWS_HOOK); flushed, so kill -9 keeps it."""
    line = {"sample": first_sample, "rank": layout.rank, "world_size": layout.world_size,
            "micro_batch_size": layout.micro_batch_size, "rows": [int(row) for row in row_ids]}
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(line) + "\n")
