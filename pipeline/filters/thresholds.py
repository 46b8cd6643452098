"""Filter stage: which ``filters:`` keys of a manifest are thresholds (verdicts over stored attributes) and which
change what is measured, so a threshold-only change re-decides an ingested run without reading its sources.

The functions take a manifest's ``filters:`` (:class:`pipeline.manifest.FilterConfig`) as the pydantic model it is:
:mod:`pipeline.manifest` compares manifests with them, so this module cannot import it back."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

THRESHOLD_KEYS: tuple[str, ...] = (
    "min_chars", "max_control_char_fraction", "min_mean_word_length", "max_mean_word_length", "max_symbol_ratio",
    "max_duplicate_line_fraction", "language.allowed", "language.min_score", "quality_classifier.min_score",
    "gopher_repetition.dup_para_frac", "gopher_repetition.dup_para_char_frac", "gopher_repetition.dup_line_frac",
    "gopher_repetition.dup_line_char_frac", "gopher_repetition.top_n_grams", "gopher_repetition.dup_n_grams",
    "gopher_quality.min_doc_words", "gopher_quality.max_doc_words", "gopher_quality.min_avg_word_length",
    "gopher_quality.max_avg_word_length", "gopher_quality.max_symbol_word_ratio",
    "gopher_quality.max_bullet_lines_ratio", "gopher_quality.max_ellipsis_lines_ratio",
    "gopher_quality.min_alpha_words_ratio", "gopher_quality.min_stop_words",
    "c4.min_num_sentences", "c4.filter_lorem_ipsum", "c4.filter_curly_bracket",
    "fineweb.line_punct_thr", "fineweb.line_punct_exclude_zero", "fineweb.short_line_thr",
    "fineweb.char_duplicates_ratio", "fineweb.new_line_ratio",
)
"""The ``filters.`` keys a verdict compares stored values with: changing only these (in a filter that stays on)
re-decides the run's documents from ``attributes/`` (``tokenmill prepare`` accepts it on an existing run dir). Of
``gopher_repetition.top_n_grams`` and ``dup_n_grams`` only the fractions are thresholds: their n are measured.
Every other key (``max_chars``, which also bounds what a reader parses; switching a filter on or off; the
classifier's model and label; Gopher's ``stop_words``; C4's line-removal rules; FineWeb's ``short_line_length``)
changes what is measured: a new run dir."""
N_GRAM_KEYS = ("gopher_repetition.top_n_grams", "gopher_repetition.dup_n_grams")


def measurement_settings(filters: BaseModel) -> dict[str, Any]:
    """The ``filters:`` settings the measured values depend on: all but :data:`THRESHOLD_KEYS`.

    None is left out, so a manifest without an optional filter fingerprints as before the key existed."""
    settings = filters.model_dump(mode="json", exclude_none=True)
    for key in THRESHOLD_KEYS:
        parent, _, name = key.rpartition(".")
        holder = settings.get(parent) if parent else settings
        if isinstance(holder, dict) and name in holder:
            value = holder.pop(name)
            if key in N_GRAM_KEYS:  # the n are measured, the fractions are thresholds
                holder[f"{name}_n"] = sorted(int(n) for n in value)
    return settings


def decision_settings(filters: BaseModel) -> dict[str, Any]:
    """``{threshold key: value}`` of :data:`THRESHOLD_KEYS` (a key of a filter that is off is left out)."""
    settings = filters.model_dump(mode="json")
    values = {}
    for key in THRESHOLD_KEYS:
        value: Any = settings
        for name in key.split("."):
            value = value.get(name) if isinstance(value, dict) else None
        if value is not None:
            values[key] = value
    return values


def changes_only_thresholds(before: BaseModel, after: BaseModel) -> bool:
    """Whether two ``filters:`` differ in :data:`THRESHOLD_KEYS` only (equal filters included)."""
    return measurement_settings(before) == measurement_settings(after)
