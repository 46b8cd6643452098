"""Evaluation results: one (checkpoint, task) -> ``eval/results/step-NNNNNNN/<task>.json``, keyed by two fingerprints.

A result file holds the checkpoint's fingerprint (the sha256 of its ``manifest.json``, which lists the sha256 of
every file it holds) and the task's (its settings and data), its status (``ok`` or ``failed`` with the error
that says what to fix) and its rows. A result is current when both fingerprints match: a re-run evaluates only
what is missing, failed or stale, and a file is written atomically once its task finished, so a run killed in
the middle of an evaluation keeps every finished result. The rows are what the ``eval_results`` view serves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa

from core.files.atomic import read_json, sha256_file
from core.layout import CHECKPOINT_MANIFEST, EVAL_RESULT_FILES, RELATIVE, run_key
from core.numbers import rounded
from core.rundir import RunPaths, fingerprint

RESULT_VERSION = 1
VAL_SPLIT_TASK = "val_split"
"""The whole validation split: loss, perplexity and bits per byte, overall and per source."""
SCORED_TOKENS = ("assistant", "last_assistant", "all", "loss_mask")
"""What a supervised fine-tuning run's val-split loss is over: its recipe's ``chat.loss`` (``loss_mask``: the chat
shards' mask, whatever made it)."""
RESULT_COLUMNS = ("step", "checkpoint", "task", "metric", "value", "stderr", "num_samples", "source")
PREFERENCE_TASK = "preference"
"""A DPO run's val split as preference pairs (:mod:`trainer.eval.preference`): the DPO loss and reward metrics of
the val pairs under the checkpoint, overall and per source, beside every pair's scores in
``preference_logps.parquet``."""
PREFERENCE_SCORES_SCHEMA = pa.schema([
    pa.field("step", pa.int64(), nullable=False),
    pa.field("split", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("doc_id", pa.int64(), nullable=False),
    pa.field("chosen_logp", pa.float32(), nullable=False),
    pa.field("rejected_logp", pa.float32(), nullable=False),
    pa.field("chosen_tokens", pa.int32(), nullable=False),
    pa.field("rejected_tokens", pa.int32(), nullable=False),
], metadata={"format": "tokenmill.preference_logps", "format_version": "1"})
"""``eval/results/step-N/preference_logps.parquet``: one row per pair of both splits' preference shards, the
checkpoint's summed log-probs of its chosen and rejected completion (float32, as computed) and each side's number of
loss tokens (SimPO's normalisation; a per-token log-prob in SQL). ``doc_id`` is the pair's document."""


def checkpoint_fingerprint(folder: Path) -> str:
    """The sha256 of the checkpoint's manifest (which holds the sha256 of every other file): its identity."""
    return sha256_file(folder / CHECKPOINT_MANIFEST)


def val_split_fingerprint(shard_digests: dict[str, str], tokenizer_sha256: str, precision: str) -> str:
    """What the whole-split scores depend on besides the weights: the val shards, the tokenizer, the precision."""
    return fingerprint("eval-val-split", RESULT_VERSION, sorted(shard_digests.items()), tokenizer_sha256, precision)


def read_result(path: Path) -> dict[str, Any] | None:
    """The result stored at ``path``; None when there is none or it is unreadable (it is then recomputed)."""
    try:
        result = read_json(path)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("version") == RESULT_VERSION else None


def is_current(result: dict[str, Any] | None, checkpoint_fp: str, task_fp: str) -> bool:
    """True when ``result`` finished (status ok) for this very checkpoint and task."""
    return (result is not None and result.get("status") == "ok" and result.get("checkpoint_fingerprint") ==
            checkpoint_fp and result.get("task_fingerprint") == task_fp)


def write_result(paths: RunPaths, step: int, task: str, checkpoint_fp: str, task_fp: str,
                 rows: list[dict[str, Any]] | None = None, error: str | None = None,
                 scored_tokens: str | None = None, chat_template: bool = False) -> dict[str, Any]:
    """Record a finished task (``rows``) or a failed one (``error``, one line saying what to fix); returns it.

    A supervised fine-tuning run's results say how they were scored: ``scored_tokens`` (the val split's loss is over
    the trained tokens only: ``assistant`` under ``chat.loss: assistant``) and ``chat_template: true`` (a downstream
    task's prompts went through the model's chat template). Neither key is written for a pretraining run.
    """
    result = {"version": RESULT_VERSION, "step": step, "task": task, "checkpoint": run_key(RELATIVE.checkpoint(step)),
              "checkpoint_fingerprint": checkpoint_fp, "task_fingerprint": task_fp,
              "status": "failed" if error is not None else "ok", "error": error, "rows": rows or []}
    if scored_tokens is not None:
        result["scored_tokens"] = scored_tokens
    if chat_template:
        result["chat_template"] = True
    paths.write_json(paths.eval_result(step, task), result)
    return result


def val_split_rows(scores: dict[str, float]) -> list[dict[str, Any]]:
    """An :class:`trainer.eval.evaluate.Evaluator` result over the whole split as result rows (source None = all)."""
    rows = [_row("loss", scores["val_loss"], scores["val_rows"], None),
            _row("perplexity", scores["val_ppl"], scores["val_rows"], None),
            _row("bits_per_byte", scores["val_bpb"], scores["val_rows"], None),
            _row("tokens", scores["val_tokens"], scores["val_rows"], None),
            _row("bytes", scores["val_bytes"], scores["val_rows"], None)]
    for key, value in sorted(scores.items()):
        for prefix, metric in (("val_loss/", "loss"), ("val_bpb/", "bits_per_byte")):
            if key.startswith(prefix):
                rows.append(_row(metric, value, None, key.removeprefix(prefix)))
    return rows


def _row(metric: str, value: float, num_samples: int | None, source: str | None) -> dict[str, Any]:
    return {"metric": metric, "value": float(value), "stderr": None, "num_samples": num_samples, "source": source}


def result_files(paths: RunPaths) -> list[Path]:
    """Every stored result file, in (step, task) order."""
    return sorted(paths.eval_results.glob(EVAL_RESULT_FILES))


def all_rows(paths: RunPaths, files: list[Path] | None = None) -> list[dict[str, Any]]:
    """Every row of every finished result (of ``files``, default all), with its step, checkpoint and task: the
    ``eval_results`` view (columns RESULT_COLUMNS)."""
    rows = []
    for path in result_files(paths) if files is None else files:
        result = read_result(path)
        if result is None or result.get("status") != "ok":
            continue
        for row in result.get("rows", []):
            value = row.get("value")
            rows.append({"step": result["step"], "checkpoint": result["checkpoint"],
                         "task": row.get("task") or result["task"],  # a group's subtasks name themselves
                         "metric": row.get("metric"),
                         "value": None if value is None or not math.isfinite(value) else value,
                         "stderr": row.get("stderr"), "num_samples": row.get("num_samples"),
                         "source": row.get("source")})
    return rows


def failed_results(paths: RunPaths) -> list[dict[str, Any]]:
    """``{step, task, error}`` of every recorded failure (shown in the report and the flow's summary)."""
    failed = []
    for path in result_files(paths):
        result = read_result(path)
        if result is not None and result.get("status") == "failed":
            failed.append({"step": result["step"], "task": result["task"], "error": result["error"]})
    return failed


def describe(result: dict[str, Any]) -> str:
    """One line for logs: the task, the step and its main numbers."""
    if result["status"] != "ok":
        return f"{result['task']} @ step {result['step']}: failed: {result['error']}"
    shown = {row["metric"]: rounded(row["value"]) for row in result["rows"] if row.get("source") is None}
    return f"{result['task']} @ step {result['step']}{_how_scored(result)}: {json.dumps(shown, default=str)}"


def _how_scored(result: dict[str, Any]) -> str:
    """`` (loss on assistant tokens)``, `` (chat template)`` or nothing: a supervised fine-tuning run's label."""
    notes = []
    if result.get("scored_tokens") in SCORED_TOKENS:  # a result file is data: only a known label is shown
        notes.append(f"loss on {result['scored_tokens']} tokens")
    if result.get("chat_template") is True:
        notes.append("chat template")
    return f" ({', '.join(notes)})" if notes else ""
