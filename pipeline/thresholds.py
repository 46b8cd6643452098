"""Filter stage: which ``filters:`` keys of a manifest are thresholds (verdicts over stored attributes) and which
change what is measured, so a threshold-only change re-decides an ingested run without reading its sources."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pipeline.manifest compares manifests with these functions
    from pipeline.manifest import FilterConfig

THRESHOLD_KEYS: tuple[str, ...] = (
    "min_chars", "max_control_char_fraction", "min_mean_word_length", "max_mean_word_length", "max_symbol_ratio",
    "max_duplicate_line_fraction", "language.allowed", "language.min_score", "quality_classifier.min_score",
)
"""The ``filters.`` keys a verdict compares stored values with: changing only these (in a filter that stays on)
re-decides the run's documents from ``attributes/`` (``tokenmill prepare`` accepts it on an existing run dir).
Every other key (``max_chars``, which also bounds what a reader parses; switching a filter on or off; the
classifier's model and label; every Gopher, C4 and FineWeb setting, whose statistics are not stored yet) changes
what is measured: a new run dir."""


def measurement_settings(filters: FilterConfig) -> dict[str, Any]:
    """The ``filters:`` settings the measured values depend on: all but :data:`THRESHOLD_KEYS`.

    None is left out, so a manifest without an optional filter fingerprints as before the key existed."""
    settings = filters.model_dump(mode="json", exclude_none=True)
    for key in THRESHOLD_KEYS:
        parent, _, name = key.rpartition(".")
        holder = settings.get(parent) if parent else settings
        if isinstance(holder, dict):
            holder.pop(name, None)
    return settings


def decision_settings(filters: FilterConfig) -> dict[str, Any]:
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


def changes_only_thresholds(before: FilterConfig, after: FilterConfig) -> bool:
    """Whether two ``filters:`` differ in :data:`THRESHOLD_KEYS` only (equal filters included)."""
    return measurement_settings(before) == measurement_settings(after)
