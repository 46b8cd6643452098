"""Chat shards: the token-shard contract plus each token's loss mask, as data (write, read; no tokenizer needed).

A chat shard is a token shard (:func:`core.schemas.shard_schema`: ``input_ids``, ``doc_ids``, ``doc_starts``,
``first_doc_offset``, ``num_tokens``, in that order, same metadata) with two columns appended:

- ``loss_mask``: ``fixed_size_list<uint8>[seq_len]``, position by position beside ``input_ids``: 1 where that token
  is a training target (the logits of the position before it predict it), 0 for prompt tokens, padding and the
  first token of every conversation (the position before it belongs to another conversation, or to none). So a
  row's labels are ``where(loss_mask, input_ids, -100)``, the layout :func:`trainer.model.llama.next_token_loss` shifts,
  and ``sum(loss_mask)`` is exactly the number of tokens the row trains on.
- ``num_loss_tokens``: ``int32``, that sum (``sequences`` queries count trained tokens without reading the masks).

Each ``doc_ids`` entry is a conversation and each conversation lies whole in one row (``first_doc_offset`` is 0),
so ``doc_starts`` gives document masking and restarting positions exactly as for pretraining shards.
Why columns and not a sidecar file: one file per shard keeps the index's sha256, the atomic write and the
``shards/`` layout unchanged, and ``table.select(shard_schema(...).names)`` is a plain token shard. Why uint8 and
not bool: Arrow packs bools into bits; uint8 memory-maps into a zero-copy [rows, seq_len] array like the tokens.

Readers that take columns by name (:class:`core.shards.store.ShardTokens`,
:class:`trainer.loader.document_mask.ShardDocStarts`) read chat shards as they are; the readers that compare the
whole column list (the ``sequences`` view, ``shards verify``) accept :func:`chat_shard_schema` too, and ``shards
verify`` checks each loss mask (:func:`verify_loss_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import ShardFormatError
from core.rundir import RunPaths
from core.schemas import FORMAT_VERSION
from core.shards.chat_schema import CHAT_COLUMNS as CHAT_COLUMNS  # re-exported: the chat shard's names live here
from core.shards.chat_schema import LOSS_MASK_TYPE, chat_shard_schema
from core.shards.chat_schema import verify_loss_masks as verify_loss_masks
from core.shards.store import ShardInfo, ShardRows, token_dtype_for_vocab


@dataclass(frozen=True)
class ChatRows:
    """Packed chat rows ready to write: the token rows with their lineage, and uint8 ``loss_mask`` [rows, seq_len]."""

    rows: ShardRows
    loss_mask: np.ndarray

    @property
    def num_loss_tokens(self) -> list[int]:
        """Tokens each row trains on."""
        return self.loss_mask.sum(axis=1, dtype=np.int64).tolist()

    def __len__(self) -> int:
        return len(self.rows)


def chat_record_batch(chat: ChatRows, dtype: np.dtype, metadata: dict[str, str]) -> pa.RecordBatch:
    """The rows as one record batch of :func:`chat_shard_schema` (token ids stored as ``dtype``)."""
    rows = chat.rows
    seq_len = rows.input_ids.shape[1]
    schema = chat_shard_schema(pa.from_numpy_dtype(dtype), seq_len, metadata)
    tokens = pa.array(np.ascontiguousarray(rows.input_ids, dtype=dtype).reshape(-1))
    mask = pa.array(np.ascontiguousarray(chat.loss_mask, dtype=np.uint8).reshape(-1))
    return pa.record_batch(
        [
            pa.FixedSizeListArray.from_arrays(tokens, type=schema.field("input_ids").type),
            pa.array(rows.doc_ids, type=pa.list_(pa.int64())),
            pa.array(rows.doc_starts, type=pa.list_(pa.int32())),
            pa.array(rows.first_doc_offset, type=pa.int32()),
            pa.array(rows.num_tokens, type=pa.int32()),
            pa.FixedSizeListArray.from_arrays(mask, type=schema.field("loss_mask").type),
            pa.array(chat.num_loss_tokens, type=pa.int32()),
        ],
        schema=schema,
    )


def write_chat_shard(run_dir: Path, relpath: str, chat: ChatRows, *, split: str, source: str,
                     tokenizer_sha256: str, vocab_size: int, records: str | None = None) -> ShardInfo:
    """Write one chat shard atomically, with the metadata of :func:`core.shards.store.write_shard` (same bytes for the
    same rows and settings); ``records``: what its rows hold when not conversations (``preference``: whole pairs,
    :mod:`core.shards.preference`)."""
    num_rows, seq_len = chat.rows.input_ids.shape
    dtype = token_dtype_for_vocab(vocab_size)
    metadata = {
        "format_version": str(FORMAT_VERSION), "tokenizer_sha256": tokenizer_sha256,
        "seq_len": str(seq_len), "vocab_size": str(vocab_size), "dtype": dtype.name,
        "split": split, "source": source,
    }
    if records is not None:
        metadata["records"] = records
    batch = chat_record_batch(chat, dtype, metadata)
    from core.shards.check import file_sha256  # it imports core.shards

    target = run_dir / relpath
    with (RunPaths(run_dir).atomic_write(target, size_hint_bytes=batch.nbytes) as tmp,
          ipc.new_file(tmp, batch.schema, options=ipc.IpcWriteOptions(compression=None)) as out):
        out.write_batch(batch)
    return ShardInfo(relpath, split, source, num_rows, int(sum(chat.rows.num_tokens)), file_sha256(target),
                     tokenizer_sha256, seq_len)


class ShardLossMask:
    """Zero-copy, memory-mapped view of one chat shard's ``loss_mask`` as a read-only uint8 [rows, seq_len] array."""

    def __init__(self, path: Path, seq_len: int) -> None:
        """ShardFormatError naming the shard when it has no ``loss_mask`` of uint8[seq_len] (a pretraining shard)."""
        self.path = path
        self._mmap = pa.memory_map(str(path))
        try:
            reader = ipc.open_file(self._mmap)
            _check_loss_mask_type(path, reader.schema, seq_len)
            arrays = [reader.get_batch(i).column("loss_mask") for i in range(reader.num_record_batches)]
        except BaseException:
            self._mmap.close()
            raise
        views = [array.values.to_numpy(zero_copy_only=True).reshape(-1, seq_len) for array in arrays]
        if not views:
            views = [np.zeros((0, seq_len), dtype=np.uint8)]
        self.mask = views[0] if len(views) == 1 else np.concatenate(views)

    def close(self) -> None:
        self._mmap.close()


def _check_loss_mask_type(path: Path, schema: pa.Schema, seq_len: int) -> None:
    field = schema.field("loss_mask") if "loss_mask" in schema.names else None
    expected = pa.list_(pa.field("item", LOSS_MASK_TYPE, nullable=False), seq_len)
    if field is None or not field.type.equals(expected):
        found = "no loss_mask column" if field is None else f"loss_mask {field.type}"
        raise ShardFormatError(f"{path}: {found}, expected fixed_size_list<uint8>[{seq_len}]: it is not a chat "
                               "shard; supervised fine-tuning reads shards packed from conversations.")
