"""The report's plots of a DPO run: the training's rewards over steps, and each checkpoint's val pairs.

``rewards``: ``train_metrics``' ``rewards/chosen``, ``rewards/rejected`` and ``rewards/margin`` above (one scale: the
margin is chosen minus rejected) and ``rewards/accuracy`` below (a share, 0 to 1). ``preference_eval``: the
``preference`` results of the full evaluation (``eval_results``), reward accuracy above and the DPO loss below, per
source and over all (``all``), a marked point per checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from core.eval_results import PREFERENCE_TASK
from flows.report.eval_plots import plot_series

REWARD_LINES = (("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"), ("rewards/margin", "margin"))
ACCURACY = "rewards/accuracy"
PREFERENCE_PANELS = ((ACCURACY, "reward accuracy"), ("loss", "DPO loss"))


def has_rewards(train: list[dict[str, Any]]) -> bool:
    """Whether any train row logged a finite reward (a DPO run's)."""
    return any(_finite(row.get(key)) for row in train for key in (ACCURACY, *(key for key, _ in REWARD_LINES)))


def preference_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The full evaluation's rows of a DPO run's val pairs."""
    return [row for row in results if row["task"] == PREFERENCE_TASK]


def plot_rewards(axes: Any, data: dict[str, Any]) -> None:
    """Rewards above (chosen, rejected, margin), accuracy below, over the logged steps."""
    grid = axes.get_subplotspec().subgridspec(2, 1, hspace=0.1)
    axes.set_subplotspec(grid[0])
    below = axes.figure.add_subplot(grid[1], sharex=axes)
    for key, label in REWARD_LINES:
        steps, values = _series(data["train"], key)
        if steps:
            axes.plot(steps, values, label=label)
    axes.axhline(0.0, color="gray", linewidth=0.8)
    axes.set_ylabel("reward (β·log-ratio)")
    axes.legend(fontsize="small")
    axes.tick_params(labelbottom=False)
    steps, values = _series(data["train"], ACCURACY)
    below.plot(steps, values, color="tab:green")
    below.set_ylim(0, 1)
    below.set_ylabel("reward accuracy")
    below.set_xlabel("step")


def plot_preference_eval(axes: Any, data: dict[str, Any]) -> None:
    """Each checkpoint's val pairs per source (``all`` = every source): reward accuracy above, DPO loss below."""
    rows = preference_rows(data["results"])
    grid = axes.get_subplotspec().subgridspec(2, 1, hspace=0.1)
    axes.set_subplotspec(grid[0])
    below = axes.figure.add_subplot(grid[1], sharex=axes)
    for panel, (metric, label) in zip((axes, below), PREFERENCE_PANELS, strict=True):
        if not plot_series(panel, [row for row in rows if row["metric"] == metric],
                           lambda row: row["source"] or "all"):
            panel.text(0.5, 0.5, f"no {label} recorded (no stored reference log-probs)", ha="center",
                       va="center", color="gray", transform=panel.transAxes)
        panel.set_ylabel(label)
    axes.set_ylim(0, 1)
    axes.tick_params(labelbottom=False)
    axes.set_xlabel("")


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[Any], list[float]]:
    points = [(row["step"], row[key]) for row in rows if _finite(row.get(key))]
    return [step for step, _ in points], [value for _, value in points]


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
