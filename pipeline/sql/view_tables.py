"""The run's views as Arrow tables from what its files hold: built alike for a run dir on disk
(:mod:`pipeline.sql.query`) and one in a bucket (:mod:`pipeline.sql.remote_run`), so both answer a query the same
way."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import QueryError
from core.schemas import shard_schema
from core.shards.chat import CHAT_COLUMNS

TRAIN_METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("loss", pa.float64()), ("lr", pa.float64()),
                                  ("tokens_seen", pa.int64()), ("tokens_per_s", pa.float64())])
EVAL_METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("val_loss", pa.float64()), ("val_ppl", pa.float64()),
                                 ("val_rows", pa.int64()), ("val_tokens", pa.int64())])
EVAL_RESULTS_SCHEMA = pa.schema([("step", pa.int64()), ("checkpoint", pa.string()), ("task", pa.string()),
                                 ("metric", pa.string()), ("value", pa.float64()), ("stderr", pa.float64()),
                                 ("num_samples", pa.int64()), ("source", pa.string())])
TRAIN_SEGMENTS_SCHEMA = pa.schema([("segment", pa.int64()), ("start_step", pa.int64()), ("start_sample", pa.int64()),
                                   ("num_processes", pa.int64()), ("world_size", pa.int64()),
                                   ("micro_batch_size", pa.int64()), ("grad_accum_steps", pa.int64()),
                                   ("seed", pa.int64()), ("num_shards", pa.int64()), ("num_train_rows", pa.int64())])
"""``train_segments``: one row per training launch (``metrics/train_segments.jsonl``, written by the trainer)."""
EMPTY_SEQUENCES_SCHEMA = pa.schema([("input_ids", pa.list_(pa.uint16())), ("doc_ids", pa.list_(pa.int64())),
                                    ("doc_starts", pa.list_(pa.int32())), ("first_doc_offset", pa.int32()),
                                    ("num_tokens", pa.int32()), ("row_in_shard", pa.int64()), ("split", pa.string()),
                                    ("source", pa.string()), ("shard_path", pa.string())])
SEQUENCES_VIEW = "sequences"
SHARD_COLUMNS = shard_schema(pa.uint16(), 1, {}).names
CHAT_SHARD_COLUMNS = [*SHARD_COLUMNS, *CHAT_COLUMNS]
"""A chat shard's columns (core.shards.chat): the token shard's, then ``loss_mask`` and ``num_loss_tokens``."""


def empty_table(schema: pa.Schema) -> pa.Table:
    """A table of ``schema``'s columns and no rows. Not ``schema.empty_table()``: that builds each column with
    ``pa.array``, which imports pandas (0.2 s of a query's start-up) to ask whether it was handed a pandas object."""
    return pa.Table.from_batches([], schema=schema)


def jsonl_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects of JSONL text; a torn or odd line is skipped."""
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def metrics_table(rows: list[dict[str, Any]], path: Path | str, empty_schema: pa.Schema) -> pa.Table:
    """The rows of a metrics file as a table (``empty_schema`` when none); QueryError naming ``path``."""
    if not rows:
        return empty_table(empty_schema)
    try:
        return pa.Table.from_pylist(rows)
    except (pa.ArrowException, UnicodeError) as err:
        raise QueryError(f"{path}: rows do not form one table ({first_line(err)}); each key must hold one "
                         "type of value in every line: fix or remove the odd lines.") from None


def sequences_of(shards: dict[str, pa.Table], run_dir: Path | str) -> pa.Table:
    """``sequences`` from ``{shard path relative to the run dir: its checked rows}`` (see :func:`_sequences_table`)."""
    if not shards:
        return empty_table(EMPTY_SEQUENCES_SCHEMA)
    max_rows = max(table.num_rows for table in shards.values())
    row_numbers = pa.array(np.arange(max_rows, dtype=np.int64))
    zeros = pa.array(np.zeros(max_rows, dtype=np.int8))
    tables = []
    for relpath, table in shards.items():
        split, source = (folder.split("=", 1)[1] for folder in relpath.split("/")[1:3])
        indices = zeros.slice(0, table.num_rows)
        for name, values in (("row_in_shard", row_numbers.slice(0, table.num_rows)),
                             ("split", pa.DictionaryArray.from_arrays(indices, pa.array([split]))),
                             ("source", pa.DictionaryArray.from_arrays(indices, pa.array([source]))),
                             ("shard_path", pa.DictionaryArray.from_arrays(indices, pa.array([relpath])))):
            table = table.append_column(name, values)
        tables.append(table)
    try:  # a run with text and chat sources: the text rows get null loss_mask and num_loss_tokens
        return pa.concat_tables(tables, promote_options="default")
    except pa.ArrowInvalid as err:
        raise QueryError(f"{run_dir}/shards: shards have different columns ({first_line(err)} ...); every shard "
                         "of a run comes from one tokenizer and seq_len: re-run `tokenmill prepare` on a fresh "
                         "run dir.") from None


def checked_shard(open_shard: Callable[[], Any], shard: Path | str, run_dir: Path | str) -> pa.Table:
    """The rows of the shard ``open_shard()`` opens (a memory map or a stream), checked as :func:`_open_shard` says."""
    try:
        table = ipc.open_file(open_shard()).read_all().replace_schema_metadata(None)
        table.validate(full=True)
    except (pa.ArrowException, OSError) as err:
        raise QueryError(f"{shard}: not a readable Arrow IPC shard ({first_line(err)}); it is damaged or "
                         f"truncated: `tokenmill shards verify {run_dir}` lists every damaged shard; queries that "
                         "do not read `sequences` still work.") from None
    if table.column_names not in (SHARD_COLUMNS, CHAT_SHARD_COLUMNS):
        raise QueryError(f"{shard}: columns {table.column_names}, a shard has {SHARD_COLUMNS} (a chat shard adds "
                         f"{list(CHAT_COLUMNS)}); it was not written by tokenmill's packer: remove it, or re-run "
                         "`tokenmill prepare` on a fresh run dir.")
    return table


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none): one line in a QueryError."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
