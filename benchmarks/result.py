"""The benchmarks' last line: ``{"name", "ours", "baseline", "unit", "ratio"}`` as JSON."""

from __future__ import annotations

import json
from typing import Any


def print_result(name: str, ours: float, baseline: float, unit: str) -> dict[str, Any]:
    """Print the machine-readable result line (ours / baseline) and return it."""
    result = {"name": name, "ours": round(ours, 1), "baseline": round(baseline, 1), "unit": unit,
              "ratio": round(ours / baseline, 3)}
    print(json.dumps(result))
    return result
