"""Numbers as people read them: logs, summaries and the Prefect UI show 4 significant digits, not 17."""

from __future__ import annotations

import math
from typing import Any

SIGNIFICANT_DIGITS = 4
"""``6.8357657437135595`` is shown as ``6.836``: the files keep full precision, the lines people read do not."""


def rounded(value: Any) -> Any:
    """A float rounded to SIGNIFICANT_DIGITS (``6.836``); ``value`` itself when it is not a float (None, an int)
    or is a whole number (a count of tokens stored as a float keeps every digit)."""
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    return value


def rounded_floats(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, numbers) with every float :func:`rounded`."""
    if isinstance(value, dict):
        return {key: rounded_floats(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [rounded_floats(item) for item in value]
    return rounded(value)
