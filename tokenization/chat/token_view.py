"""The ``sft_tokens`` view: every token of every conversation in the run's chat shards, decoded, with whether it was
trained on (its ``loss_mask``), so SQL can show which tokens of a conversation carried loss.

One row per token: ``doc_id`` (the conversation's document), ``position`` (0-based, within the conversation),
``token_id``, ``token`` (that one token decoded with the run's tokenizer; a byte-level piece of a multi-byte
character decodes to U+FFFD), ``trained`` (1 when the token is a training target: the logits before it are scored),
and where it lies: ``split``, ``source``, ``shard_path``, ``row_in_shard``. Only chat shards the index lists are
read, each once its sha256 is the index's (as ``sequences`` does); the tokenizer is the run's ``tokenizer.json``
(or ``base_model/``'s) whose sha256 the shards record: a JSON vocabulary, parsed, never executed. Built only for a
statement that names the view (:mod:`flows.run_sql`): it is as long as the chat shards hold tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import QueryError, ShardFormatError
from core.files.atomic import sha256_file
from core.rundir import RunPaths
from core.shards.chat import CHAT_COLUMNS
from core.shards.check import checked_shard_path
from core.shards.store import ShardInfo, read_shard_index

SFT_TOKENS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("position", pa.int32()), ("token_id", pa.int64()),
                               ("token", pa.string()), ("trained", pa.int8()), ("split", pa.string()),
                               ("source", pa.string()), ("shard_path", pa.string()), ("row_in_shard", pa.int64())])


def sft_tokens_table(run_dir: Path) -> pa.Table:
    """The ``sft_tokens`` view of the run at ``run_dir`` (empty without chat shards); QueryError naming the file
    when a chat shard is damaged or no tokenizer of the run has the sha256 its shards record."""
    run_dir = Path(run_dir)
    if not RunPaths(run_dir).shard_index.is_file():
        return SFT_TOKENS_SCHEMA.empty_table()
    try:
        infos = read_shard_index(run_dir)
        chat = [(info, _chat_rows(run_dir, info)) for info in infos]
    except ShardFormatError as err:
        raise QueryError(f"{err} (`sft_tokens` reads only shards the index vouches for)") from None
    chat = [(info, table) for info, table in chat if table is not None]
    if not chat:
        return SFT_TOKENS_SCHEMA.empty_table()
    decoded = _decoder(run_dir, {info.tokenizer_sha256 for info, _ in chat})
    return pa.concat_tables([_shard_tokens(info, table, decoded) for info, table in chat])


def _chat_rows(run_dir: Path, info: ShardInfo) -> pa.Table | None:
    """The shard's rows when it is a chat shard (None for a token shard), after its sha256 check."""
    path = checked_shard_path(run_dir, info)
    try:
        table = ipc.open_file(pa.memory_map(str(path))).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError) as err:
        raise QueryError(f"{path}: not a readable Arrow IPC shard ({err}); `tokenmill shards verify {run_dir}` "
                         "lists every damaged shard") from None
    return table if all(name in table.column_names for name in CHAT_COLUMNS) else None


def _decoder(run_dir: Path, sha256s: set[str]) -> list[str]:
    """``decoded[token_id]``: each token of the run's tokenizer whose sha256 the chat shards record, decoded alone."""
    from tokenizers import Tokenizer  # the Rust tokenizers library: only for this view

    paths = RunPaths(run_dir)
    for candidate in (paths.tokenizer, paths.base_model_tokenizer):
        if candidate.is_file() and sha256_file(candidate) in sha256s:
            tokenizer = Tokenizer.from_file(str(candidate))
            size = tokenizer.get_vocab_size(with_added_tokens=True)
            return tokenizer.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=False)
    raise QueryError(f"{run_dir}: no tokenizer/tokenizer.json or base_model/tokenizer.json with the sha256 the chat "
                     "shards record; re-run `tokenmill prepare`, which writes both")


def _shard_tokens(info: ShardInfo, table: pa.Table, decoded: list[str]) -> pa.Table:
    """One row per conversation token of one chat shard (padding left out)."""
    seq_len = table.schema.field("input_ids").type.list_size
    ids = table.column("input_ids").combine_chunks().values.to_numpy().reshape(-1, seq_len)
    mask = table.column("loss_mask").combine_chunks().values.to_numpy().reshape(-1, seq_len)
    rows, starts, lengths, doc_ids = [], [], [], []
    for row, (docs, doc_starts, num_tokens) in enumerate(zip(table.column("doc_ids").to_pylist(),
                                                            table.column("doc_starts").to_pylist(),
                                                            table.column("num_tokens").to_pylist(), strict=True)):
        ends = [*doc_starts[1:], num_tokens]
        for doc_id, start, end in zip(docs, doc_starts, ends, strict=True):
            rows.append(row)
            starts.append(start)
            lengths.append(end - start)
            doc_ids.append(doc_id)
    lengths_array = np.asarray(lengths, dtype=np.int64)
    positions = np.arange(lengths_array.sum()) - np.repeat(np.cumsum(lengths_array) - lengths_array, lengths_array)
    row_of = np.repeat(np.asarray(rows, dtype=np.int64), lengths_array)
    column = np.repeat(np.asarray(starts, dtype=np.int64), lengths_array) + positions
    token_ids = ids[row_of, column].astype(np.int64)
    count = len(token_ids)
    return pa.table({
        "doc_id": np.repeat(np.asarray(doc_ids, dtype=np.int64), lengths_array),
        "position": positions.astype(np.int32), "token_id": token_ids,
        "token": pa.array([decoded[token_id] if token_id < len(decoded) else None for token_id in token_ids.tolist()],
                          pa.string()),
        "trained": mask[row_of, column].astype(np.int8),
        "split": pa.array([info.split] * count, pa.string()), "source": pa.array([info.source] * count, pa.string()),
        "shard_path": pa.array([info.path] * count, pa.string()), "row_in_shard": row_of,
    }, schema=SFT_TOKENS_SCHEMA)
