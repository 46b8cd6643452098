"""The report's plots: one matplotlib function per plot, drawn headless (Agg) into PNG bytes.

Names and values read from the run dir label the axes as text: math parsing is off, so a ``$`` in a source
name is drawn as it is, and log-scale ticks are plain numbers (their default labels are mathtext).
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from flows.report.eval_plots import plot_eval_sources, plot_eval_tasks
from flows.report.preference_plots import plot_preference_eval, plot_rewards

PLOTS: dict[str, str] = {
    "loss": "Training and validation loss",
    "lr": "Learning rate",
    "throughput": "Throughput and MFU",
    "funnel": "Data funnel per source, rejects by reason",
    "source_mix": "Source mix (documents and tokens)",
    "train_mix": "Realised training mix per step (mixture / mixture_schedule), stage boundaries dashed",
    "doc_lengths": "Document length (characters)",
    "row_fill": "Row fill (real tokens per packed row)",
    "eval_tasks": "Full evaluation: the metrics of each downstream task over steps",
    "eval_sources": "Full evaluation: the whole val split per source (loss and bits per byte)",
    "rewards": "DPO rewards in training: chosen, rejected and margin; reward accuracy below",
    "preference_eval": "Full evaluation of a DPO run: reward accuracy and DPO loss of the val pairs per checkpoint",
}
FIGSIZE: dict[str, tuple[float, float]] = {"funnel": (11, 4), "throughput": (7, 5), "eval_sources": (7, 5),
                                           "rewards": (7, 5), "preference_eval": (7, 5)}
"""Plots other than the default 7 x 3.6 inches: the funnel has a second panel (rejects by reason), the
throughput a second one below (MFU), the whole val split's loss one below it (bits per byte)."""
MAX_REASONS = 8
"""The rejects panel shows this many reasons at most; the rest share one "other" segment."""


def import_in_background() -> None:
    """Start importing matplotlib (~0.6 s) in a daemon thread, for a flow that reports after a long wait.

    A flow's process mostly waits while its stages run in worker processes or ``accelerate launch``; the
    import then costs the report nothing. A report that comes first waits on the module's import lock, as
    any second importer does; an import that fails here fails again, with its error, in the report.
    """
    def import_matplotlib() -> None:
        with contextlib.suppress(Exception):
            import matplotlib.backends.backend_agg  # the thread's work: matplotlib imported ahead
            import matplotlib.figure  # noqa: F401  (most of pyplot's import; pyplot itself picks a backend)

    threading.Thread(target=import_matplotlib, name="import-matplotlib", daemon=True).start()


def render_png(plot: Callable[[Any, dict[str, Any]], None], data: dict[str, Any],
            figsize: tuple[float, float]) -> bytes:
    with drawn_figure(plot, data, figsize) as figure:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()


@contextlib.contextmanager
def drawn_figure(plot: Callable[[Any, dict[str, Any]], None], data: dict[str, Any],
                 figsize: tuple[float, float]) -> Iterator[Any]:
    """The matplotlib figure of one plot as the report draws it (Agg, no mathtext), closed after the block."""
    import matplotlib  # matplotlib (~0.6 s): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib (~0.6 s): only when a plot is drawn

    # Source names label the axes: "$...$" in one must be drawn as it is, not parsed (a bad formula raised).
    with matplotlib.rc_context({"text.parse_math": False}):
        figure, axes = plt.subplots(figsize=figsize, dpi=100)
        try:
            plot(axes, data)
            for panel in figure.axes:
                _plain_log_ticks(panel)
            figure.tight_layout()
            yield figure
        finally:
            plt.close(figure)


def _plain_log_ticks(axes: Any) -> None:
    """Log-scale ticks as plain numbers: their default labels are mathtext (``$\\mathdefault{10^{1}}$``), which
    is drawn as that raw text once math parsing is off."""
    # matplotlib (~0.6 s): only when a plot is drawn
    from matplotlib.ticker import FuncFormatter, LogFormatter, NullFormatter

    for axis in (axes.xaxis, axes.yaxis):
        if isinstance(axis.get_major_formatter(), LogFormatter):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}"))
            axis.set_minor_formatter(NullFormatter())


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[Any], list[Any]]:
    """``(steps, values)`` of the rows with a finite ``key`` (MFU is NaN where the device's peak is unknown)."""
    points = [(row["step"], row[key]) for row in rows
              if row.get(key) is not None and math.isfinite(row[key])]
    return [p[0] for p in points], [p[1] for p in points]


def _no_data(axes: Any, message: str) -> None:
    axes.text(0.5, 0.5, message, ha="center", va="center", color="gray", transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def _plot_loss(axes: Any, data: dict[str, Any]) -> None:
    train, evals = _series(data["train"], "loss"), _series(data["eval"], "val_loss")
    if not train[0] and not evals[0]:
        _no_data(axes, "no training metrics yet")
        return
    axes.plot(*train, label="train loss")
    axes.plot(*evals, marker="o", label="validation loss")
    axes.set_xlabel("step")
    # a DPO run's loss is per pair: -log sigmoid of its reward margin (train_metrics' and the in-loop eval's)
    axes.set_ylabel("DPO loss (per pair)" if data.get("train_mode") == "dpo" else "cross-entropy (nats/token)")
    tokens = _tokens_seen(data["train"])
    if tokens is not None:
        steps, seen = tokens
        top = axes.secondary_xaxis("top", functions=(lambda s: _interp(s, steps, seen),
                                                     lambda t: _interp(t, seen, steps)))
        top.set_xlabel("tokens seen")
    axes.legend()


def _tokens_seen(train: list[dict[str, Any]]) -> tuple[list[float], list[float]] | None:
    """Step -> cumulative ``tokens_seen`` as logged (from (0, 0)), kept strictly increasing in both."""
    steps, seen = [0.0], [0.0]
    for row in train:
        step, tokens = row.get("step"), row.get("tokens_seen")
        if step is not None and tokens is not None and step > steps[-1] and tokens > seen[-1]:
            steps.append(float(step))
            seen.append(float(tokens))
    return (steps, seen) if len(steps) > 1 else None


def _interp(x: Any, xp: list[float], fp: list[float]) -> Any:
    """Piecewise-linear through ``(xp, fp)``, extended past both ends along the end segments (axis margins)."""
    x = np.asarray(x, dtype=float)
    low = (fp[1] - fp[0]) / (xp[1] - xp[0])
    high = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
    inside = np.interp(x, xp, fp)
    return np.where(x < xp[0], fp[0] + (x - xp[0]) * low,
                    np.where(x > xp[-1], fp[-1] + (x - xp[-1]) * high, inside))


def _plot_lr(axes: Any, data: dict[str, Any]) -> None:
    steps, lr = _series(data["train"], "lr")
    if not steps:
        _no_data(axes, "no training metrics yet")
        return
    axes.plot(steps, lr)
    axes.set_xlabel("step")
    axes.set_ylabel("learning rate")


def _plot_throughput(axes: Any, data: dict[str, Any]) -> None:
    """Tokens/s above, MFU below, each on its own scale and panel.

    MFU is tokens/s times a constant (FLOPs per token / the device's peak), so on two y-axes of one panel the
    two lines coincide and the one drawn last hides the other.
    """
    speed, (steps, mfu) = _series(data["train"], "tokens_per_s"), _series(data["train"], "mfu")
    if not speed[0] and not steps:
        _no_data(axes, "no training metrics yet")
        return
    grid = axes.get_subplotspec().subgridspec(2, 1, hspace=0.1)
    axes.set_subplotspec(grid[0])
    axes.plot(*speed, color="tab:blue")
    axes.set_ylabel("tokens/s")
    axes.set_ylim(bottom=0)
    below = axes.figure.add_subplot(grid[1], sharex=axes)
    axes.tick_params(labelbottom=False)
    below.set_xlabel("step")
    below.set_ylabel("MFU (%)")
    if mfu:
        below.plot(steps, [100 * value for value in mfu], color="tab:orange")
        below.set_ylim(bottom=0)
    else:
        below.text(0.5, 0.5, "MFU unknown: the device's peak was not measured", ha="center", va="center",
                   color="gray", transform=below.transAxes)


def _plot_funnel(axes: Any, data: dict[str, Any]) -> None:
    """Left: every stage per source (symlog). Right: each source's rejects stacked by reason."""
    grid = axes.get_subplotspec().subgridspec(1, 2, width_ratios=(3, 2), wspace=0.3)
    axes.set_subplotspec(grid[0])
    _plot_stages(axes, data["funnel"])
    _plot_rejects(axes.figure.add_subplot(grid[1]), data["rejects"])


def _plot_stages(axes: Any, funnel: list[dict[str, Any]]) -> None:
    axes.set_title("funnel", fontsize="medium")
    if not funnel:
        _no_data(axes, "no records read yet")
        return
    stages = ["records_read", "rejected", "exact_duplicates", "near_duplicates", "contaminated", "kept"]
    width = 0.8 / len(funnel)
    for offset, row in enumerate(funnel):
        axes.bar([i + offset * width for i in range(len(stages))], [row[s] for s in stages], width, label=row["source"])
    axes.set_xticks(range(len(stages)), ["read", "rejected", "exact dups", "near dups", "contaminated", "kept"],
                    rotation=20)
    axes.set_yscale("symlog")  # rejects and duplicates are often 1% of what was read: keep them visible
    axes.set_ylabel("records")
    axes.legend(title="source", fontsize="small")


def _plot_rejects(axes: Any, rejects: list[dict[str, Any]]) -> None:
    axes.set_title("rejected, by reason", fontsize="medium")
    if not rejects:
        _no_data(axes, "no rejected records")
        return
    sources = sorted({row["source"] for row in rejects})
    counts = _top_reasons(rejects)
    left = [0] * len(sources)
    colors = _reason_colors(len(counts))
    for (reason, per_source), color in zip(counts.items(), colors, strict=True):
        values = [per_source.get(source, 0) for source in sources]
        axes.barh(range(len(sources)), values, left=left, label=reason, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axes.set_yticks(range(len(sources)), sources)
    axes.invert_yaxis()  # first source on top, as in the tables
    axes.set_xlabel("rejected records")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _top_reasons(rejects: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """``{reason: {source: records}}``, most frequent reason first; past MAX_REASONS the rest are "other"."""
    totals: dict[str, int] = {}
    for row in rejects:
        totals[row["reason"]] = totals.get(row["reason"], 0) + row["records"]
    ranked = sorted(totals, key=lambda reason: (-totals[reason], reason))
    shown = ranked if len(ranked) <= MAX_REASONS else ranked[:MAX_REASONS - 1]
    other = f"other ({len(ranked) - len(shown)} reasons)"
    counts: dict[str, dict[str, int]] = {reason: {} for reason in shown}
    for row in rejects:
        per_source = counts.setdefault(row["reason"] if row["reason"] in shown else other, {})
        per_source[row["source"]] = per_source.get(row["source"], 0) + row["records"]
    return counts


def _reason_colors(count: int) -> list[Any]:
    """Set2, unlike the sources' tab10 colors on the left; its 8th color (gray) falls on "other"."""
    import matplotlib  # matplotlib (~0.6 s): only when a plot is drawn

    palette = matplotlib.colormaps["Set2"].colors
    return [palette[i % len(palette)] for i in range(count)]


def _plot_source_mix(axes: Any, data: dict[str, Any]) -> None:
    if not data["mix"]:
        _no_data(axes, "no documents yet")
        return
    sources = [row["source"] for row in data["mix"]]
    docs = [row["docs"] for row in data["mix"]]
    tokens = [row["tokens"] for row in data["mix"]]
    total_docs, total_tokens = max(1, sum(docs)), max(1, sum(tokens))
    positions = range(len(sources))
    axes.bar([p - 0.2 for p in positions], [100 * d / total_docs for d in docs], 0.4, label="documents")
    axes.bar([p + 0.2 for p in positions], [100 * t / total_tokens for t in tokens], 0.4, label="tokens")
    axes.set_xticks(list(positions), sources)
    axes.set_ylabel("share (%)")
    axes.legend()


def _plot_train_mix(axes: Any, data: dict[str, Any]) -> None:
    """Each source's share of the samples of every train row (the steps since the previous row), stacked; a
    dashed line after the last row of each stage (a row whose steps span a boundary holds both stages)."""
    rows = data["mix_steps"]
    if not rows:
        _no_data(axes, "no mixture weights (every train row equally likely)")
        return
    steps = sorted({row["step"] for row in rows})
    sources = sorted({row["source"] for row in rows})
    samples = {(row["step"], row["source"]): 0 for row in rows}
    last_step_of_stage: dict[int, int] = {}
    for row in rows:
        samples[(row["step"], row["source"])] += row["samples"]
        last_step_of_stage[row["stage"]] = max(last_step_of_stage.get(row["stage"], 0), row["step"])
    totals = {step: max(1, sum(samples.get((step, name), 0) for name in sources)) for step in steps}
    shares = [[100 * samples.get((step, name), 0) / totals[step] for step in steps] for name in sources]
    axes.stackplot(steps, shares, labels=sources, step="pre")
    for stage, step in sorted(last_step_of_stage.items())[:-1]:
        axes.axvline(step, color="black", linestyle="--", linewidth=1)
        axes.text(step, 101, f"end of stage {stage}", fontsize="small", ha="right", va="bottom")
    axes.set_xlabel("step")
    axes.set_ylabel("share of samples (%)")
    axes.set_ylim(0, 100)
    axes.legend(fontsize="small", loc="lower left")


def _plot_doc_lengths(axes: Any, data: dict[str, Any]) -> None:
    if not data["doc_lengths"]:
        _no_data(axes, "no documents yet")
        return
    axes.hist(data["doc_lengths"], bins=50, log=True)
    axes.set_xlabel("characters per document")
    axes.set_ylabel("documents")


def _plot_row_fill(axes: Any, data: dict[str, Any]) -> None:
    if not data["row_fill"]:
        _no_data(axes, "no packed rows yet")
        return
    axes.hist(data["row_fill"], bins=40)
    axes.set_xlabel("real tokens in the row")
    axes.set_ylabel("rows")


PLOT_FUNCTIONS = {"loss": _plot_loss, "lr": _plot_lr, "throughput": _plot_throughput, "funnel": _plot_funnel,
                  "source_mix": _plot_source_mix, "train_mix": _plot_train_mix, "doc_lengths": _plot_doc_lengths,
                  "row_fill": _plot_row_fill,
                  "eval_tasks": plot_eval_tasks, "eval_sources": plot_eval_sources, "rewards": plot_rewards,
                  "preference_eval": plot_preference_eval}
