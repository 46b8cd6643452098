"""Read-only SQL over a run, the one way to open one: every view, pipeline's data views and the trainer's.

``connect`` (notebooks) and ``run_query`` (``tokenmill query``, the report, the Prefect artifacts) are the only
public ways to open a run for SQL. They live here because only ``flows`` sees every package: the data views are
built by :mod:`pipeline.sql.query`, and ``consumed`` and ``row_losses`` are the trainer's own data order replayed
(:mod:`trainer.metrics.consumed`), which pipeline cannot import (the layering rule), so they are handed in from here.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

from core.schemas import CONSUMED_SCHEMA, ROW_LOSSES_SCHEMA
from pipeline.sql import query
from tokenization.chat.token_view import SFT_TOKENS_SCHEMA


def consumed_table(run_dir: Path) -> pa.Table:
    """:func:`trainer.metrics.consumed.consumed_table`, imported when a statement names the view (it imports torch)."""
    from trainer.metrics.consumed import consumed_table  # imports torch: only for the consumed view

    return consumed_table(run_dir)


def row_losses_table(run_dir: Path) -> pa.Table:
    """:func:`trainer.metrics.consumed.row_losses_table`, imported when a statement names the view."""
    from trainer.metrics.consumed import row_losses_table  # imports torch: only for row_losses

    return row_losses_table(run_dir)


def sft_tokens_table(run_dir: Path) -> pa.Table:
    """:func:`tokenization.chat.token_view.sft_tokens_table`, imported when a statement names the view."""
    from tokenization.chat.token_view import sft_tokens_table  # the tokenizers library: only for sft_tokens

    return sft_tokens_table(run_dir)


TRAINING_VIEWS: dict[str, query.DerivedView] = {
    "consumed": (consumed_table, CONSUMED_SCHEMA),
    "row_losses": (row_losses_table, ROW_LOSSES_SCHEMA),
    "sft_tokens": (sft_tokens_table, SFT_TOKENS_SCHEMA),
}
"""Views derived by the trainer's and the tokenizer's code (pipeline cannot import either), built only for a
statement that names them: ``sft_tokens`` decodes every token of the chat shards (tokenization.chat.token_view)."""
UNREAD_TRAINING_VIEWS: dict[str, query.DerivedView] = {
    name: (lambda run_dir, schema=schema: query.empty_table(schema), schema)
    for name, (_, schema) in TRAINING_VIEWS.items()
}
"""The same views, registered empty (``connect(..., trainer_views=False)``)."""


def view_names() -> list[str]:
    """Every view a statement may name, in the order ``tokenmill query --help`` lists them."""
    return [*query.VIEWS, *TRAINING_VIEWS]


def connect(run_dir: str | Path, sql: str | None = None, *,
            trainer_views: bool = True) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with every view of :func:`view_names`, unable to write or read other files.

    For notebooks: ``connect("runs/tiny").sql("SELECT ...").df()``. ``run_dir`` may be a URL
    (``s3://bucket/runs/NAME``). ``sql``, when given, is the one statement the connection is for: views it does
    not name and that are not read straight from Parquet are left empty (see :func:`pipeline.sql.query.open_views`).
    ``trainer_views=False`` leaves ``consumed`` and ``row_losses`` empty whatever is asked: they replay every
    training step through the trainer's loader (importing torch: seconds), and the report reads neither.
    Raises QueryError naming the folder or file when the run dir holds what tokenmill would not write.
    """
    return query.open_views(run_dir, sql, TRAINING_VIEWS if trainer_views else UNREAD_TRAINING_VIEWS)


def run_query(run_dir: str | Path, sql: str) -> pa.Table:
    """Run one read-only statement (SELECT, WITH … SELECT, DESCRIBE, SUMMARIZE, EXPLAIN) over every view.

    Raises QueryError with one line: a statement that could write, more or fewer than one statement, a DuckDB
    error (its hints kept), or a run dir tokenmill would not write.
    """
    return query.run_statement(run_dir, sql, TRAINING_VIEWS)
