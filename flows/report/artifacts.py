"""What a run shows in the Prefect UI: the data funnel, rejects, shard stats, the eval table and a summary.

Every key is the run's own (:func:`flows.report.artifact_keys.artifact_key`: ``tiny-data-funnel``), so two runs
published to one server keep apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from core.eval_results import PREFERENCE_TASK, VAL_SPLIT_TASK, failed_results
from core.numbers import rounded
from core.rundir import RunPaths
from flows.report.artifact_keys import artifact_key
from flows.run_sql import run_query
from pipeline.filters.screen import REJECT_REASONS
from pipeline.shard_stats import shard_stats
from pipeline.sql.query import data_funnel, eval_history, eval_results_table, rejects_by_reason

NO_REJECTS = "(none)"
"""The ``reason`` of a source's row in ``rejects-by-reason`` when none of its records was rejected."""


def publish_funnel(run_dir: Path, summary: dict[str, Any], report_path: str) -> None:
    """Data funnel, rejects and shard-stats tables, and a data-only ``run-summary`` linking the report."""
    funnel = data_funnel(run_dir)
    create_table_artifact(table=funnel, key=artifact_key(run_dir, "data-funnel"),
                          description=f"Records read, rejected, deduplicated and kept per source in {run_dir}")
    create_table_artifact(table=rejects_table(funnel, rejects_by_reason(run_dir)),
                          key=artifact_key(run_dir, "rejects-by-reason"),
                          description="Rejected records by reason (a source without rejects has one row of 0)")
    create_table_artifact(table=shard_stats(run_dir), key=artifact_key(run_dir, "shard-stats"),
                          description=f"{summary['num_shards']} Arrow token shards, {summary['num_tokens']:,} tokens, "
                                      "per split and source (`tokenmill shards stats`)")
    create_markdown_artifact(
        key=artifact_key(run_dir, "run-summary"),
        markdown=(f"# tokenmill run `{run_dir.name}`\n\nData prepared: {summary['num_shards']} shards, "
                  f"{summary['num_tokens']:,} tokens.\n\n{report_link(report_path)}"),
        description="Run summary",
    )


def publish_training(run_dir: Path, report_path: str) -> dict[str, Any]:
    """The in-loop eval table and the ``run-summary`` artifact; returns the run's validation losses, the exported
    model and the report.

    Call it after the full evaluation: ``final_val_loss`` is the whole val split's loss at the newest evaluated
    step (None when the full evaluation has not run), the figure the report's headline shows. The training loop's
    numbers score a fixed subset of the split and are always named so: ``val_loss_subset``.
    """
    evals = eval_history(run_dir)
    if evals:
        create_table_artifact(table=[{"step": row["step"], "val_loss_subset": row["val_loss"],
                                      "val_ppl_subset": row["val_ppl"]} for row in evals],
                              key=artifact_key(run_dir, "eval-metrics"),
                              description="In-loop validation loss and perplexity on a fixed subset of the val "
                                          "split (`eval-results` has the whole split)")
    whole, subset = whole_split_loss(run_dir), run_query(run_dir, SUBSET_LOSS_SQL).to_pylist()
    summary = {
        "final_val_loss": rounded(whole["value"]) if whole else None,
        "final_val_loss_step": whole["step"] if whole else None,
        "val_loss_subset": {"first": rounded(subset[0]["val_loss"]) if subset else None,
                            "final": rounded(subset[-1]["val_loss"]) if subset else None},
        "final_step": subset[-1]["step"] if subset else None,
        "model_dir": str(RunPaths(run_dir).model),
        "report": report_path,
    }
    create_markdown_artifact(key=artifact_key(run_dir, "run-summary"), markdown=_training_markdown(run_dir, summary),
                             description="Run summary")
    return summary


SUBSET_LOSS_SQL = "SELECT step, val_loss FROM eval_metrics WHERE val_loss IS NOT NULL ORDER BY step"
"""The in-loop evaluations' loss (a fixed subset of the val split), unrounded: one rounding, for people."""
WHOLE_SPLIT_LOSS_SQL = (f"SELECT step, value FROM eval_results WHERE task IN ('{VAL_SPLIT_TASK}', '{PREFERENCE_TASK}') "
                        "AND metric = 'loss' AND source IS NULL AND value IS NOT NULL ORDER BY step DESC LIMIT 1")
"""The full evaluation's loss over the whole val split at its newest step (a DPO run's: the DPO loss of every val
pair, as its in-loop ``val_loss`` is of a subset; a constant: no data in the SQL)."""


def whole_split_loss(run_dir: Path) -> dict[str, Any] | None:
    """``{step, value}``: the full evaluation's loss over the whole val split at its newest step, else None."""
    rows = run_query(run_dir, WHOLE_SPLIT_LOSS_SQL).to_pylist()
    return rows[0] if rows else None


def _training_markdown(run_dir: Path, summary: dict[str, Any]) -> str:
    subset = summary["val_loss_subset"]
    whole = ("not evaluated (the recipe's eval section is off)" if summary["final_val_loss"] is None else
             f"**{summary['final_val_loss']}** (step {summary['final_val_loss_step']})")
    return (f"# tokenmill run `{run_dir.name}`\n\nFinal validation loss, whole val split: {whole}.\n\n"
            f"In-loop validation loss (a fixed subset of the val split): {subset['first']} (step 0) → "
            f"{subset['final']} (step {summary['final_step']}).\n\nModel exported to `{summary['model_dir']}`.\n\n"
            f"{report_link(summary['report'])}")


def publish_evaluation(run_dir: Path, report_path: str) -> dict[str, Any]:
    """The ``eval-results`` table (every checkpoint x task x metric) and the failures; returns both."""
    results = eval_results_table(run_dir)
    failed = failed_results(RunPaths(run_dir))
    if results:
        create_table_artifact(table=results, key=artifact_key(run_dir, "eval-results"),
                              description="Full evaluation: the whole val split (per source, bits per byte) and "
                                          "the downstream tasks, per checkpoint")
    if failed:
        create_table_artifact(table=failed, key=artifact_key(run_dir, "eval-failures"),
                              description="Evaluations that failed, and why")
    return {"results": results, "failed": failed, "report": report_path}


def publish_training_failure(run_dir: Path, report_path: str, error: BaseException) -> None:
    """A ``run-summary`` for a training run that failed: the error and the report written after it."""
    message = str(error) if len(str(error)) <= 500 else str(error)[:500] + " …"
    create_markdown_artifact(
        key=artifact_key(run_dir, "run-summary"),
        markdown=(f"# tokenmill run `{run_dir.name}`\n\n**Training failed**: {type(error).__name__}: {message}"
                  f"\n\n{report_link(report_path)}"),
        description="Run summary (training failed)",
    )


def rejects_table(funnel: list[dict[str, Any]], rejects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``source, reason, records, meaning`` per rejected reason, and ``(none), 0`` for each source without a
    rejected record: the table exists, and says so, when nothing was rejected."""
    rows = [{**row, "meaning": REJECT_REASONS.get(row["reason"], "")} for row in rejects]
    rejected = {row["source"] for row in rejects}
    rows += [{"source": row["source"], "reason": NO_REJECTS, "records": 0, "meaning": "no record was rejected"}
             for row in funnel if row["source"] not in rejected]
    if not rows:
        rows = [{"source": NO_REJECTS, "reason": NO_REJECTS, "records": 0, "meaning": "no record was read yet"}]
    return sorted(rows, key=lambda row: (row["source"], row["reason"]))


def report_link(report_path: str) -> str:
    """The report as a ``file://`` link (opens from a local Prefect UI) and as a plain path to copy."""
    path = Path(report_path).resolve()
    return f"Report: [{path}]({path.as_uri()}) (path: `{path}`)"

