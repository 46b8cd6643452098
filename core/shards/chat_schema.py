"""A chat shard's schema and the check of its loss masks: what the shard store needs of chat shards to verify them.

Apart from :mod:`core.shards.chat` (which writes and reads chat shards with the store's types) so that
:mod:`core.shards.store` can verify a chat shard without importing the module that imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.schemas import shard_schema
from core.shards.preference import PREFERENCE_RECORDS, RECORDS_KEY, check_preference_rows


class IndexedShard(Protocol):
    """What the mask check reads of an index row (:class:`core.shards.store.ShardInfo`, which imports this module)."""

    path: str
    seq_len: int


LOSS_MASK_TYPE = pa.uint8()
CHAT_COLUMNS = ("loss_mask", "num_loss_tokens")
"""The columns a chat shard adds after the token shard's."""


def chat_shard_schema(token_type: pa.DataType, seq_len: int, metadata: dict[str, str]) -> pa.Schema:
    """:func:`core.schemas.shard_schema` with ``loss_mask`` and ``num_loss_tokens`` appended (see the module doc)."""
    schema = shard_schema(token_type, seq_len, metadata)
    schema = schema.append(pa.field("loss_mask", pa.list_(pa.field("item", LOSS_MASK_TYPE, nullable=False), seq_len),
                                    nullable=False))
    return schema.append(pa.field("num_loss_tokens", pa.int32(), nullable=False))



def verify_loss_masks(path: Path, info: IndexedShard) -> list[str]:
    """``shards verify``'s faults of a chat shard's masks: a value other than 0/1, a ``num_loss_tokens`` that is not
    its row's sum, a trained position in the row's padding; and, for a preference shard (``records: preference``),
    a row that does not hold whole pairs or a side with no loss token (none: all good)."""
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
    metadata = table.schema.metadata or {}
    is_preference = metadata.get(RECORDS_KEY.encode()) == PREFERENCE_RECORDS.encode()
    pairs = check_preference_rows(Path(info.path), table) if is_preference else []
    mask = table.column("loss_mask").combine_chunks().values.to_numpy().reshape(-1, info.seq_len)
    faults = []
    if mask.size and int(mask.max()) > 1:
        faults.append(f"{info.path}: loss_mask holds {int(mask.max())}; a mask is 0 or 1")
    recorded = np.asarray(table.column("num_loss_tokens").to_pylist(), dtype=np.int64)
    if not np.array_equal(recorded, mask.sum(axis=1, dtype=np.int64)):
        faults.append(f"{info.path}: num_loss_tokens differs from the sum of loss_mask in some row")
    lengths = np.asarray(table.column("num_tokens").to_pylist(), dtype=np.int64)
    if mask.size and (mask * (np.arange(info.seq_len) >= lengths[:, None])).any():
        faults.append(f"{info.path}: loss_mask marks padding (a position after the row's num_tokens)")
    return faults + pairs
