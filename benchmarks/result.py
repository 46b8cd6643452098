"""The benchmarks' last line: ``{"name", "ours", "baseline", "unit", "ratio"}`` as JSON."""

from __future__ import annotations

import json
from typing import Any


def print_result(name: str, ours: float, baseline: float, unit: str) -> dict[str, Any]:
    """Print the machine-readable result line (ours / baseline) and return it.

    Values keep 3 significant digits, not a fixed number of decimals: a re-decision of 0.04 s printed as 0.0.
    """
    result = {"name": name, "ours": _significant(ours), "baseline": _significant(baseline), "unit": unit,
              "ratio": round(ours / baseline, 3)}
    print(json.dumps(result))
    return result


def _significant(value: float) -> float:
    return float(f"{value:.3g}")
