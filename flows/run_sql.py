"""Read-only SQL over a run with every view: pipeline's data views plus the trainer's ``consumed`` and ``row_losses``.

``pipeline.query`` cannot import the trainer (the layering rule), and those two views are the trainer's own data
order replayed (:mod:`trainer.consumed`), so they are joined here: ``tokenmill query`` and notebooks
(``flows.run_sql.connect(RUN_DIR)``) see them; ``pipeline.query.connect`` has the data views only.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa

from core.schemas import CONSUMED_SCHEMA, ROW_LOSSES_SCHEMA
from pipeline import query


def consumed_table(run_dir: Path) -> pa.Table:
    """:func:`trainer.consumed.consumed_table`, imported when a statement names the view (it imports torch)."""
    from trainer.consumed import consumed_table  # imports torch: only for the consumed view

    return consumed_table(run_dir)


def row_losses_table(run_dir: Path) -> pa.Table:
    """:func:`trainer.consumed.row_losses_table`, imported when a statement names the view."""
    from trainer.consumed import row_losses_table  # imports torch: only for row_losses

    return row_losses_table(run_dir)


TRAINING_VIEWS: dict[str, query.DerivedView] = {
    "consumed": (consumed_table, CONSUMED_SCHEMA),
    "row_losses": (row_losses_table, ROW_LOSSES_SCHEMA),
}
"""Views derived by the trainer's code, built only for a statement that names them."""


def view_names() -> list[str]:
    """Every view a statement may name, in the order ``tokenmill query --help`` lists them."""
    return [*query.VIEWS, *TRAINING_VIEWS]


def connect(run_dir: str | Path, sql: str | None = None) -> duckdb.DuckDBPyConnection:
    """:func:`pipeline.query.connect` with the ``consumed`` and ``row_losses`` views too."""
    return query.connect(run_dir, sql, TRAINING_VIEWS)


def run_query(run_dir: str | Path, sql: str) -> pa.Table:
    """:func:`pipeline.query.run_query` with the ``consumed`` and ``row_losses`` views too."""
    return query.run_query(run_dir, sql, TRAINING_VIEWS)
