"""What a run shows in the Prefect UI: the data funnel, shard stats, the eval table and a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from core.eval_results import failed_results
from core.rundir import RunPaths
from pipeline.query import data_funnel, eval_history, eval_results_table, rejects_by_reason


def publish_funnel(run_dir: Path, summary: dict[str, Any], report_path: str) -> None:
    """Data funnel and rejects tables, shard stats and a data-only ``run-summary`` linking the report."""
    create_table_artifact(table=data_funnel(run_dir), key="data-funnel",
                          description=f"Records read, rejected, deduplicated and kept per source in {run_dir}")
    reasons = rejects_by_reason(run_dir)
    if reasons:
        create_table_artifact(table=reasons, key="rejects-by-reason", description="Rejected records by reason")
    create_markdown_artifact(
        key="shard-stats",
        markdown=f"**{summary['num_shards']} shards**, {summary['num_tokens']:,} tokens in `{run_dir}/shards`.",
        description="Arrow token shards of the run",
    )
    create_markdown_artifact(
        key="run-summary",
        markdown=(f"# tokenmill run `{run_dir.name}`\n\nData prepared: {summary['num_shards']} shards, "
                  f"{summary['num_tokens']:,} tokens.\n\n{report_link(report_path)}"),
        description="Run summary",
    )


def publish_training(run_dir: Path, report_path: str) -> dict[str, Any]:
    """Eval table + summary artifact; returns first/last validation loss and the exported model path."""
    evals = eval_history(run_dir)
    if evals:
        create_table_artifact(table=evals, key="eval-metrics", description="Validation loss and perplexity")
    summary = {
        "first_val_loss": evals[0]["val_loss"] if evals else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "final_step": evals[-1]["step"] if evals else None,
        "model_dir": str(RunPaths(run_dir).model),
        "report": report_path,
    }
    create_markdown_artifact(
        key="run-summary",
        markdown=(f"# tokenmill run `{run_dir.name}`\n\nvalidation loss {summary['first_val_loss']} (step 0) → "
                  f"{summary['final_val_loss']} (step {summary['final_step']}); model exported to "
                  f"`{summary['model_dir']}`.\n\n{report_link(report_path)}"),
        description="Run summary",
    )
    return summary


def publish_evaluation(run_dir: Path, report_path: str) -> dict[str, Any]:
    """The ``eval-results`` table (every checkpoint x task x metric) and the failures; returns both."""
    results = eval_results_table(run_dir)
    failed = failed_results(RunPaths(run_dir))
    if results:
        create_table_artifact(table=results, key="eval-results",
                              description="Full evaluation: the whole val split (per source, bits per byte) and "
                                          "the downstream tasks, per checkpoint")
    if failed:
        create_table_artifact(table=failed, key="eval-failures", description="Evaluations that failed, and why")
    return {"results": results, "failed": failed, "report": report_path}


def publish_training_failure(run_dir: Path, report_path: str, error: BaseException) -> None:
    """A ``run-summary`` for a training run that failed: the error and the report written after it."""
    message = str(error) if len(str(error)) <= 500 else str(error)[:500] + " …"
    create_markdown_artifact(
        key="run-summary",
        markdown=(f"# tokenmill run `{run_dir.name}`\n\n**Training failed**: {type(error).__name__}: {message}"
                  f"\n\n{report_link(report_path)}"),
        description="Run summary (training failed)",
    )


def report_link(report_path: str) -> str:
    """The report as a ``file://`` link (opens from a local Prefect UI) and as a plain path to copy."""
    path = Path(report_path).resolve()
    return f"Report: [{path}]({path.as_uri()}) (path: `{path}`)"

