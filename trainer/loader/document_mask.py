"""Document masking: the shards' ``doc_starts`` -> per-token positions and an attention mask within each document.

A packed row holds several documents; with ``train.document_masking`` a token attends only to earlier tokens of
its own document, and positions (RoPE) restart at 0 where each document starts, so a document's logits in a
packed row are the logits it would get alone (a document continued from the previous row starts at position 0
of its row). The row's documents travel to the model as ``position_ids`` [batch, seq_len]: a 0 starts a document.
That is the packed-sequence convention transformers reads (``masking_utils.find_packed_sequence_indices``), so
the built-in model and Hugging Face models take the same tensor.

The mask is a boolean [batch, 1, seq_len, seq_len] for ``F.scaled_dot_product_attention``: measured on CPU with
torch 2.13 (see docs/training.md), flex_attention has no CPU backward at all, and its forward was 9-23x slower
than SDPA with a mask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from core.errors import ShardFormatError


class ShardDocStarts:
    """The ``doc_starts`` column of one shard (where each document begins in each row), checked once on open."""

    def __init__(self, path: Path, seq_len: int) -> None:
        """Raises ShardFormatError naming the shard when a row's starts do not begin at 0, do not increase, or fall
        outside ``[0, seq_len)``: such a row cannot be split into documents."""
        try:
            with pa.memory_map(str(path)) as source:
                column = ipc.open_file(source).read_all().column("doc_starts").combine_chunks()
        except (pa.ArrowInvalid, KeyError, OSError) as err:
            raise ShardFormatError(f"{path}: no readable doc_starts column ({err}); re-run `tokenmill prepare`.") \
                from None
        self.offsets = column.offsets.to_numpy().astype(np.int64)
        self.values = column.values.to_numpy().astype(np.int64)
        fault = doc_starts_fault(self.offsets, self.values, seq_len)
        if fault is not None:
            raise ShardFormatError(f"{path}: doc_starts {fault}; the shard was not written by tokenmill's packer, "
                                   "re-run `tokenmill prepare` in a fresh run dir.")

    def row(self, row: int) -> np.ndarray:
        """Where each document of row ``row`` starts (token offsets, ascending, the first 0)."""
        return self.values[self.offsets[row]:self.offsets[row + 1]]


def doc_starts_fault(offsets: np.ndarray, values: np.ndarray, seq_len: int) -> str | None:
    """Why flat ``doc_starts`` (list offsets + values) cannot describe rows of ``seq_len`` tokens; None if they can."""
    lengths = np.diff(offsets)
    if (lengths < 1).any():
        return f"is empty in row {int(np.argmax(lengths < 1))}"
    if values[offsets[:-1]].any():
        return f"does not start at 0 in row {int(np.argmax(values[offsets[:-1]] != 0))}"
    if ((values < 0) | (values >= seq_len)).any():
        return f"holds {int(values[(values < 0) | (values >= seq_len)][0])}, outside [0, {seq_len})"
    new_row = np.zeros(len(values), dtype=bool)
    new_row[offsets[:-1]] = True
    if (np.diff(values)[~new_row[1:]] <= 0).any():
        return "does not increase within a row"
    return None


def position_ids(doc_starts: list[np.ndarray], seq_len: int) -> np.ndarray:
    """int64 [rows, seq_len]: each token's offset from the start of its document (0 where a document starts).

    Padding after a row's last document continues that document's positions (its labels are ignored anyway).
    """
    num_rows = len(doc_starts)
    starts_at = np.zeros((num_rows, seq_len), dtype=np.int64)
    for row, starts in enumerate(doc_starts):
        starts_at[row, starts] = starts
    return np.arange(seq_len, dtype=np.int64)[None, :] - np.maximum.accumulate(starts_at, axis=1)


def document_attention_mask(positions: torch.Tensor) -> torch.Tensor:
    """bool [batch, 1, seq, seq] from ``positions`` [batch, seq]: True where query i may attend key j (j <= i, and
    no document starts in between). Built on the positions' device, once per forward and shared by every layer."""
    document = (positions == 0).cumsum(dim=1)
    same_document = document[:, :, None] == document[:, None, :]
    seq_len = positions.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    return (same_document & causal)[:, None]
