"""The report's plots of the full evaluation (``eval_results``): downstream tasks, and the whole val split per source
(a DPO run's val pairs: :mod:`flows.report.preference_plots`).

Checkpoints are few (often one): a score is a marked point at the step of its checkpoint, and the step axis is
ticked at exactly those steps (a lone point got ticks 192.5 … 207.5 around step 200).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_STEP_TICKS = 10
"""Up to this many checkpoints each gets a tick of its own; past it, matplotlib picks integer steps."""
NO_RESULTS = "none yet (eval.tasks; tokenmill eval RUN_DIR)"
VAL_SPLIT_PANELS = (("loss", "loss (nats/token)"), ("bits_per_byte", "bits per byte"))
"""The whole val split's metrics, one panel each: the two units differ (a nat is 1.44 bits, per token vs per byte)."""

Row = dict[str, Any]
WHOLE_SPLIT_TASKS = ("val_split", "preference")
"""Results of the whole val split (its token loss; a DPO run's pairs): not downstream tasks."""


def plot_eval_tasks(axes: Any, data: dict[str, Any]) -> None:
    """One line per (task, metric) of the downstream tasks over the checkpoints' steps."""
    # the val split and a DPO run's val pairs have plots of their own
    rows = [row for row in data["results"] if row["task"] not in WHOLE_SPLIT_TASKS]
    if not plot_series(axes, rows, lambda row: f"{row['task']} {row['metric']}"):
        _no_results(axes)
        return
    axes.set_ylabel("score")


def plot_eval_sources(axes: Any, data: dict[str, Any]) -> None:
    """The whole val split per source (``all`` = every source): loss above, bits per byte below, one x axis."""
    rows = [row for row in data["results"] if row["task"] == "val_split"]
    by_metric = {metric: [row for row in rows if row["metric"] == metric] for metric, _ in VAL_SPLIT_PANELS}
    if not any(row["value"] is not None for metric_rows in by_metric.values() for row in metric_rows):
        _no_results(axes)
        return
    grid = axes.get_subplotspec().subgridspec(2, 1, hspace=0.1)
    axes.set_subplotspec(grid[0])
    below = axes.figure.add_subplot(grid[1], sharex=axes)
    for panel, (metric, label) in zip((axes, below), VAL_SPLIT_PANELS, strict=True):
        if not plot_series(panel, by_metric[metric], lambda row: row["source"] or "all"):
            panel.text(0.5, 0.5, f"no {label} recorded", ha="center", va="center", color="gray",
                       transform=panel.transAxes)
        panel.set_ylabel(label)
    axes.tick_params(labelbottom=False)
    axes.set_xlabel("")


def plot_series(axes: Any, rows: list[Row], label_of: Callable[[Row], str]) -> bool:
    """One marked line per label over the steps of ``rows``; False (nothing drawn) when no row has a value."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        if row["value"] is not None:
            steps, values = series.setdefault(label_of(row), ([], []))
            steps.append(row["step"])
            values.append(row["value"])
    if not series:
        return False
    for label, (steps, values) in sorted(series.items()):
        axes.plot(steps, values, marker="o", label=label)
    _step_ticks(axes, sorted({step for steps, _ in series.values() for step in steps}))
    axes.set_xlabel("step")
    axes.legend(fontsize="small")
    return True


def _step_ticks(axes: Any, steps: list[int]) -> None:
    """Ticks at the checkpoints' steps (integers; a lone one centred on a padded axis), or integer steps."""
    from matplotlib.ticker import MaxNLocator  # matplotlib (~0.6 s): only when a plot is drawn

    if len(steps) > MAX_STEP_TICKS:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        return
    axes.set_xticks(steps, [f"{step:,}" for step in steps])
    if len(steps) == 1:
        pad = max(1, steps[0] // 10)
        axes.set_xlim(steps[0] - pad, steps[0] + pad)


def _no_results(axes: Any) -> None:
    axes.text(0.5, 0.5, NO_RESULTS, ha="center", va="center", color="gray", transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])
