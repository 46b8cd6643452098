"""Numbers as people read them (core/numbers.py): 4 significant digits, counts and non-floats untouched."""

from __future__ import annotations

import math

from core.eval_results import describe
from core.numbers import rounded, rounded_floats


def test_floats_get_four_significant_digits_and_nothing_else_changes() -> None:
    assert rounded(6.8357657437135595) == 6.836 and rounded(0.000123456) == 0.0001235
    assert rounded(12345.0) == 12345.0 and rounded(7) == 7 and rounded(None) is None and rounded("6.83576") == "6.83576"
    assert math.isnan(rounded(math.nan)) and rounded(math.inf) == math.inf
    assert rounded_floats({"a": [1.23456, {"b": 2}], "c": (3.14159,)}) == {"a": [1.235, {"b": 2}], "c": [3.142]}


def test_a_logged_result_line_shows_four_significant_digits() -> None:
    result = {"status": "ok", "task": "val_split", "step": 30,
              "rows": [{"metric": "loss", "value": 6.8357657437135595, "source": None},
                       {"metric": "tokens", "value": 51200.0, "source": None},
                       {"metric": "loss", "value": 7.123456, "source": "web"}]}
    assert describe(result) == 'val_split @ step 30: {"loss": 6.836, "tokens": 51200.0}'
