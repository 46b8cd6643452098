"""Which report plots carry no information, and the sentence the page says instead of drawing each.

A plot of nothing (no metrics yet), of one source (100% of documents and of tokens) or of one value (every
packed row full, a constant learning rate) is a box around a fact: the page states the fact instead.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from core.eval_results import PREFERENCE_TASK
from flows.report.preference_plots import has_rewards, preference_rows


def uninformative_plots(data: dict[str, Any]) -> dict[str, str]:
    """``{plot name: why it is not drawn}`` for the report's ``data`` (see
    :func:`flows.report.stage.collect_report_data`)."""
    reasons = {
        "loss": _no_training(data, "loss") if not _finite(data["eval"], "val_loss") else None,
        "lr": _no_training(data, "lr") or _one_value(_finite(data["train"], "lr"), "the learning rate is constant"),
        "throughput": _no_training(data, "tokens_per_s"),
        "funnel": None if data["funnel"] else "no records read yet",
        "source_mix": _source_mix(data["mix"]),
        "train_mix": None if data["mix_steps"] else "no mixture weights: every train row equally likely",
        "doc_lengths": _doc_lengths(data["doc_lengths"]),
        "row_fill": _row_fill(data["row_fill"], data["num_packed_pairs"]),
        "eval_tasks": None if _results(data, downstream=True) else "no downstream task results (eval.tasks)",
        "eval_sources": None if _results(data, downstream=False) else "no full evaluation of the val split yet",
        "rewards": None if has_rewards(data["train"]) else "no DPO rewards logged (train.mode: dpo logs them)",
        "preference_eval": None if any(row["value"] is not None for row in preference_rows(data["results"]))
        else "no full evaluation of preference pairs (tokenmill eval of a DPO run)",
    }
    return {name: why for name, why in reasons.items() if why is not None}


def _finite(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [row[key] for row in rows if isinstance(row.get(key), int | float) and math.isfinite(row[key])]


def _no_training(data: dict[str, Any], key: str) -> str | None:
    return None if _finite(data["train"], key) else "no training metrics yet"


def _one_value(values: list[float], fact: str) -> str | None:
    """``fact`` and the value when every value is the same one, else None."""
    return f"{fact}: {values[0]:g}" if values and len(set(values)) == 1 else None


def _source_mix(mix: list[dict[str, Any]]) -> str | None:
    if not mix:
        return "no documents yet"
    if len(mix) == 1:
        return f"one source ({mix[0]['source']}): 100% of the documents and of the tokens"
    return None


def _doc_lengths(lengths: list[int]) -> str | None:
    if not lengths:
        return "no documents yet"
    return _one_value(lengths, "every document has the same number of characters")


def _row_fill(fills: list[int], num_pairs: int) -> str | None:
    """Hidden when every row holds the same number of real tokens but at most one per (split, source): packing
    pads only the last row of each, so that histogram is one bar."""
    if not fills:
        return "no packed rows yet"
    full, num_full = Counter(fills).most_common(1)[0]
    partial = len(fills) - num_full
    if partial > num_pairs:
        return None
    tail = f" but the last of each split and source ({partial} row{'s' if partial != 1 else ''}, padded)"
    return f"every packed row holds {full:,} real tokens" + (tail if partial else "")


def _results(data: dict[str, Any], *, downstream: bool) -> bool:
    """Downstream task results, or the val split's loss or bits per byte (a DPO run's pairs are neither)."""
    return any(row["value"] is not None and row["task"] != PREFERENCE_TASK
               and (row["task"] != "val_split") == downstream
               and (downstream or row["metric"] in ("loss", "bits_per_byte")) for row in data["results"])
