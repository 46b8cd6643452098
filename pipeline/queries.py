"""Named SQL questions about a run, over the read-only views of :func:`pipeline.query.connect`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.query import connect

FUNNEL_SQL = """
WITH read_docs AS (SELECT source, count(*) AS n FROM _docs GROUP BY source),
     rej AS (SELECT source, count(*) AS n FROM rejects WHERE reason <> 'contaminated' GROUP BY source),
     contaminated AS (SELECT source, count(*) AS n FROM rejects WHERE reason = 'contaminated' GROUP BY source),
     dup AS (SELECT source, count(*) FILTER (WHERE kind = 'exact') AS exact,
                    count(*) FILTER (WHERE kind = 'near') AS near FROM duplicates GROUP BY source),
     kept AS (SELECT source, count(*) AS n FROM documents GROUP BY source)
SELECT s.source,
       coalesce(r.n, 0) + coalesce(j.n, 0) AS records_read,
       coalesce(j.n, 0) AS rejected,
       coalesce(d.exact, 0) AS exact_duplicates,
       coalesce(d.near, 0) AS near_duplicates,
       coalesce(c.n, 0) AS contaminated,
       coalesce(k.n, 0) AS kept
FROM (SELECT source FROM read_docs UNION SELECT source FROM rej) s
LEFT JOIN read_docs r USING (source) LEFT JOIN rej j USING (source)
LEFT JOIN dup d USING (source) LEFT JOIN contaminated c USING (source) LEFT JOIN kept k USING (source)
ORDER BY s.source
"""
REJECTS_BY_REASON_SQL = "SELECT source, reason, count(*) AS records FROM rejects GROUP BY ALL ORDER BY source, reason"
EVAL_SQL = "SELECT step, round(val_loss, 4) AS val_loss, round(val_ppl, 2) AS val_ppl FROM eval_metrics ORDER BY step"
TOKEN_MIX_SQL = """
WITH docs AS (SELECT split, source, count(*) AS num_documents, sum(num_chars) AS num_chars
              FROM documents GROUP BY ALL),
     toks AS (SELECT split, source, count(*) AS num_shards, sum(num_rows) AS num_rows, sum(num_tokens) AS num_tokens
              FROM shards GROUP BY ALL)
SELECT split, source, coalesce(d.num_documents, 0) AS num_documents, coalesce(d.num_chars, 0)::BIGINT AS num_chars,
       t.num_shards, t.num_rows::BIGINT AS num_rows, t.num_tokens::BIGINT AS num_tokens,
       round(100 * t.num_tokens / sum(t.num_tokens) OVER (PARTITION BY split), 2) AS pct_of_split_tokens,
       round(t.num_tokens / nullif(d.num_chars, 0), 4) AS tokens_per_char
FROM toks t LEFT JOIN docs d USING (split, source)
ORDER BY split, source
"""
NEAR_DUPLICATE_PAIRS_SQL = """
SELECT d.similarity, d.source, d.doc_id, d.uri AS removed_uri, d.duplicate_of, k.uri AS kept_uri
FROM duplicates d LEFT JOIN _docs k ON k.doc_id = d.duplicate_of
WHERE d.kind = 'near'
ORDER BY d.similarity DESC, d.doc_id
"""


def _rows(run_dir: Path, sql: str) -> list[dict[str, Any]]:
    con = connect(run_dir)
    try:
        return con.sql(sql).to_arrow_table().to_pylist()
    finally:
        con.close()


def data_funnel(run_dir: Path) -> list[dict[str, Any]]:
    """Per source: ``source, records_read, rejected, exact_duplicates, near_duplicates, contaminated, kept``.

    ``records_read`` counts every record once: a contaminated document is in ``docs`` and in ``rejects``.
    """
    return _rows(run_dir, FUNNEL_SQL)


def rejects_by_reason(run_dir: Path) -> list[dict[str, Any]]:
    """Per source and reason: ``source, reason, records``."""
    return _rows(run_dir, REJECTS_BY_REASON_SQL)


def eval_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every evaluation: ``step, val_loss, val_ppl``."""
    return _rows(run_dir, EVAL_SQL)


def token_mix(run_dir: Path) -> list[dict[str, Any]]:
    """Per split and source: ``split, source, num_documents, num_chars, num_shards, num_rows, num_tokens``
    (EOS included, padding excluded), ``pct_of_split_tokens``, ``tokens_per_char``."""
    return _rows(run_dir, TOKEN_MIX_SQL)


def near_duplicate_pairs(run_dir: Path) -> list[dict[str, Any]]:
    """Every near duplicate with its survivor, most similar first:
    ``similarity, source, doc_id, removed_uri, duplicate_of, kept_uri``."""
    return _rows(run_dir, NEAR_DUPLICATE_PAIRS_SQL)
