"""Named SQL questions about a run, over the read-only views of :func:`pipeline.query.connect`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.query import connect

FUNNEL_SQL = """
WITH read_docs AS (SELECT source, count(*) AS n FROM _docs GROUP BY source),
     rej AS (SELECT source, count(*) AS n FROM rejects GROUP BY source),
     dup AS (SELECT source, count(*) FILTER (WHERE kind = 'exact') AS exact,
                    count(*) FILTER (WHERE kind = 'near') AS near FROM duplicates GROUP BY source),
     kept AS (SELECT source, count(*) AS n FROM documents GROUP BY source)
SELECT s.source,
       coalesce(r.n, 0) + coalesce(j.n, 0) AS records_read,
       coalesce(j.n, 0) AS rejected,
       coalesce(d.exact, 0) AS exact_duplicates,
       coalesce(d.near, 0) AS near_duplicates,
       coalesce(k.n, 0) AS kept
FROM (SELECT source FROM read_docs UNION SELECT source FROM rej) s
LEFT JOIN read_docs r USING (source) LEFT JOIN rej j USING (source)
LEFT JOIN dup d USING (source) LEFT JOIN kept k USING (source)
ORDER BY s.source
"""
REJECTS_BY_REASON_SQL = "SELECT source, reason, count(*) AS records FROM rejects GROUP BY ALL ORDER BY source, reason"
EVAL_SQL = "SELECT step, round(val_loss, 4) AS val_loss, round(val_ppl, 2) AS val_ppl FROM eval_metrics ORDER BY step"


def _rows(run_dir: Path, sql: str) -> list[dict[str, Any]]:
    con = connect(run_dir)
    try:
        return con.sql(sql).to_arrow_table().to_pylist()
    finally:
        con.close()


def data_funnel(run_dir: Path) -> list[dict[str, Any]]:
    """Per source: ``source, records_read, rejected, exact_duplicates, near_duplicates, kept``."""
    return _rows(run_dir, FUNNEL_SQL)


def rejects_by_reason(run_dir: Path) -> list[dict[str, Any]]:
    """Per source and reason: ``source, reason, records``."""
    return _rows(run_dir, REJECTS_BY_REASON_SQL)


def eval_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every evaluation: ``step, val_loss, val_ppl``."""
    return _rows(run_dir, EVAL_SQL)
