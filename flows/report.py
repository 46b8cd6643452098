"""The run report: ``report/index.html`` (self-contained, opens offline) + ``report.md`` + PNG plots.

It opens on a headline (:mod:`flows.report_headline`), then the tables, then the plots that carry information
(:mod:`flows.report_visibility` says which do not, and the page says why each is left out).

Names and values read from the run dir (sources, reasons, metrics) are text, never markup: HTML-escaped in
the page, escaped in the Markdown, and drawn without mathtext in the plots.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.eval_results import failed_results
from core.rundir import RunPaths, file_stats, fingerprint
from flows.report_headline import collect_headline, headline_html, headline_markdown
from flows.report_visibility import uninformative_plots
from pipeline.filters import REJECT_REASONS
from pipeline.query import connect, data_funnel, eval_results_table, rejects_by_reason
from trainer.sample_generation import sample_is_current, write_sample_generation

PLOTS: dict[str, str] = {
    "loss": "Training and validation loss",
    "lr": "Learning rate",
    "throughput": "Throughput and MFU",
    "funnel": "Data funnel per source, rejects by reason",
    "source_mix": "Source mix (documents and tokens)",
    "doc_lengths": "Document length (characters)",
    "row_fill": "Row fill (real tokens per packed row)",
    "eval_tasks": "Full evaluation: the metrics of each downstream task over steps",
    "eval_sources": "Full evaluation: the whole val split per source (loss and bits per byte)",
}
FIGSIZE: dict[str, tuple[float, float]] = {"funnel": (11, 4), "throughput": (7, 5)}
"""Plots other than the default 7 x 3.6 inches: the funnel has a second panel (rejects by reason), the
throughput a second one below (MFU)."""
MAX_REASONS = 8
"""The rejects panel shows this many reasons at most; the rest share one "other" segment."""
MARKDOWN_SPECIALS = str.maketrans({char: f"\\{char}" for char in "\\`*[]|"})
"""Backslash-escaped in a Markdown cell: no code span, emphasis, link or image, and no cell break."""


def collect_report_data(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read through the run's SQL views."""
    con = connect(run_dir)
    try:
        def rows(sql: str) -> list[dict[str, Any]]:
            return con.sql(sql).to_arrow_table().to_pylist()

        data = {
            "train": rows("SELECT * FROM train_metrics ORDER BY step"),
            "eval": rows("SELECT * FROM eval_metrics ORDER BY step"),
            "funnel": data_funnel(run_dir),
            # Contaminated documents are the funnel's own column; these rows add up to its ``rejected``.
            "rejects": [row for row in rejects_by_reason(run_dir) if row["reason"] != "contaminated"],
            "mix": rows("SELECT d.source, d.docs, coalesce(t.tokens, 0) AS tokens FROM "
                        "(SELECT source, count(*) AS docs FROM documents GROUP BY source) d LEFT JOIN "
                        "(SELECT source, sum(num_tokens) AS tokens FROM shards GROUP BY source) t USING (source) "
                        "ORDER BY d.source"),
            "doc_lengths": [r["num_chars"] for r in rows("SELECT num_chars FROM documents")],
            "row_fill": [r["num_tokens"] for r in rows("SELECT num_tokens FROM sequences")],
            "num_packed_pairs": rows("SELECT count(*) AS n FROM (SELECT DISTINCT split, source FROM shards)")[0]["n"],
            "checkpoints": _checkpoints(run_dir),
            "results": rows("SELECT * FROM eval_results ORDER BY step, task, metric, source"),
            "results_table": eval_results_table(run_dir),
            "eval_failures": failed_results(RunPaths(run_dir)),
            "contaminated_by_task": rows(
                "SELECT regexp_extract(detail, ' with eval task (\\S+) item ', 1) AS task, count(*) AS train_documents "
                "FROM rejects WHERE reason = 'contaminated' AND detail LIKE '% with eval task %' "
                "GROUP BY ALL ORDER BY task"),
        }
        data["headline"] = collect_headline(RunPaths(run_dir), con, data)
        return data
    finally:
        con.close()


def write_report(paths: RunPaths) -> Path:
    """Render every plot and write ``report/index.html``; returns its path.

    Skipped when no file it reads changed since it was last written (``stages/report.json`` records
    :func:`report_inputs_fingerprint`): rendering takes ~2 s, and each command of a run that changed
    nothing (a re-run, ``tokenmill report`` twice) asked for it up to three times.
    """
    index = paths.report / "index.html"
    if not sample_is_current(paths):  # a new export: sample it once (imports torch), the report reads the file
        write_sample_generation(paths)
    inputs = report_inputs_fingerprint(paths)
    if report_is_current(paths, inputs):
        return index
    data = collect_report_data(paths.root)
    hidden = uninformative_plots(data)
    images = {name: _render(PLOT_FUNCTIONS[name], data, FIGSIZE.get(name, (7, 3.6))) for name in PLOTS
              if name not in hidden}
    for name in PLOTS:
        if name in images:
            paths.write_bytes(paths.report / f"{name}.png", images[name])
        else:  # a plot drawn by an earlier report: it would contradict this one
            (paths.report / f"{name}.png").unlink(missing_ok=True)
    paths.write_text(paths.report / "report.md", _markdown(paths.root, data, hidden))
    paths.write_text(index, _html(paths.root, data, images, hidden))
    paths.mark_done(REPORT_STAGE, inputs, {"index": index.relative_to(paths.root).as_posix()})
    return index


REPORT_STAGE = "report"


def report_is_current(paths: RunPaths, inputs: str | None = None) -> bool:
    """Whether ``report/index.html`` exists, no file it reads changed since it was written, and the export (if
    any) has its sample generation.

    ``inputs``: :func:`report_inputs_fingerprint`, when the caller has it already.
    """
    inputs = inputs if inputs is not None else report_inputs_fingerprint(paths)
    return ((paths.report / "index.html").is_file() and paths.done_summary(REPORT_STAGE, inputs) is not None
            and sample_is_current(paths))


def report_inputs_fingerprint(paths: RunPaths) -> str:
    """Every file of the run dir the report could read, by :func:`core.rundir.file_stats`, and the code's version.

    That is every file but ``report/``, the lock, the report's own marker and ``metrics/stage_times.jsonl``:
    that log grows with every stage call, skipped ones included, so counting it would re-render the report
    on every re-run; a stage call that did work also changed the files it wrote. 7 ms on the quick start's run.
    """
    skipped = frozenset({paths.report, paths.lock_file, paths.marker(REPORT_STAGE), paths.stage_times})
    return fingerprint(REPORT_STAGE, file_stats(paths.root, paths.root, skipped))


def _checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for folder in sorted(RunPaths(run_dir).checkpoints.glob("step-*")):
        if folder.is_dir() and folder.name[5:].isdigit():
            size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
            found.append({"checkpoint": folder.name, "step": int(folder.name[5:]),
                          "complete": (folder / "manifest.json").is_file(), "size_mb": round(size / 1e6, 2)})
    return found


def _render(plot: Callable[[Any, dict[str, Any]], None], data: dict[str, Any],
            figsize: tuple[float, float]) -> bytes:
    with drawn_figure(plot, data, figsize) as figure:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()


@contextlib.contextmanager
def drawn_figure(plot: Callable[[Any, dict[str, Any]], None], data: dict[str, Any],
                 figsize: tuple[float, float]) -> Iterator[Any]:
    """The matplotlib figure of one plot as the report draws it (Agg, no mathtext), closed after the block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    axes.set_ylabel("cross-entropy (nats/token)")
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
    import numpy as np

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
    import matplotlib

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




def _table_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>none yet</p>"
    head = "".join(f"<th>{html.escape(str(key))}</th>" for key in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row.values()) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _reason_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    read = {row["source"]: row["records_read"] for row in data["funnel"]}
    return [{"source": r["source"], "reason": r["reason"], "records": r["records"],
             "% of read": round(100 * r["records"] / max(1, read.get(r["source"], 0)), 2),
             "meaning": REJECT_REASONS.get(r["reason"], "")} for r in data["rejects"]]


def _eval_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"step": r["step"], "val_loss": r.get("val_loss"), "val_ppl": r.get("val_ppl"),
             "val_rows": r.get("val_rows"), "val_tokens": r.get("val_tokens")} for r in data["eval"]]


def subset_note(data: dict[str, Any]) -> str:
    """What the in-loop numbers cover: a fixed subset of the val split, not all of it."""
    last = data["eval"][-1] if data["eval"] else {}
    if not last.get("val_rows"):
        return "The in-loop evaluation scores a fixed subset of the validation rows."
    total = last.get("val_split_rows")
    of = f" of the {total:,}" if total else ""
    return (f"In-loop evaluation: a fixed subset of {last['val_rows']:,}{of} validation rows "
            f"({last.get('val_tokens', 0):,} tokens), the same at every step; the full evaluation below scores "
            "every row.")


def _plot_eval_tasks(axes: Any, data: dict[str, Any]) -> None:
    rows = [row for row in data["results"] if row["task"] != "val_split"]  # the val split has its own plot
    _plot_result_series(axes, rows, lambda row: f"{row['task']} {row['metric']}", "score")


def _plot_eval_sources(axes: Any, data: dict[str, Any]) -> None:
    rows = [row for row in data["results"] if row["task"] == "val_split" and row["metric"] in ("loss", "bits_per_byte")]
    _plot_result_series(axes, rows, lambda row: f"{row['source'] or 'all'} {row['metric']}", "nats/token, bits/byte")


def _plot_result_series(axes: Any, rows: list[dict[str, Any]], label_of: Callable[[dict[str, Any]], str],
                        ylabel: str) -> None:
    """One line per label over the steps of the full evaluation's rows (``eval_results``)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        if row["value"] is not None:
            steps, values = series.setdefault(label_of(row), ([], []))
            steps.append(row["step"])
            values.append(row["value"])
    if not series:
        _no_data(axes, "none yet (eval.tasks; tokenmill eval RUN_DIR)")
        return
    for label, (steps, values) in sorted(series.items()):
        axes.plot(steps, values, marker="o", label=label)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.legend(fontsize="small")


STYLE = """body{font-family:sans-serif;margin:1.5em 2em}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(12em,1fr));gap:.8em;margin:1em 0}
.card{border:1px solid #ccc;border-radius:6px;padding:.6em .8em}.card .value{font-size:1.6em;font-weight:bold}
.label,.note{color:#555;font-size:.9em}
.columns{display:grid;grid-template-columns:repeat(auto-fit,minmax(28em,1fr));gap:1.5em}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f6f6;padding:.6em;overflow-x:auto}
.plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(32em,1fr));gap:1em}
figure{margin:0}figure.wide{grid-column:1/-1}figure img{width:100%;height:auto}"""
"""Full page width: the headline's figures and the plots fill as many columns as the window holds."""
WIDE_PLOTS = frozenset({"funnel"})
"""Plots drawn wider than the others (two panels side by side): they take a whole row of the grid."""


def _html(run_dir: Path, data: dict[str, Any], images: dict[str, bytes], hidden: dict[str, str]) -> str:
    figures = "".join(_figure_html(name, title, images[name]) for name, title in PLOTS.items() if name in images)
    left_out = "".join(f"<li>{html.escape(PLOTS[name])}: {html.escape(why)}</li>" for name, why in hidden.items())
    left_out = f"<p>Not drawn, as they would show nothing more:</p><ul>{left_out}</ul>" if left_out else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill run {html.escape(run_dir.name)}</title>
<style>{STYLE}</style></head>
<body><h1>tokenmill run <code>{html.escape(run_dir.name)}</code></h1>
{headline_html(data["headline"], _table_html)}
<h2>Data funnel</h2>{_table_html(data["funnel"])}
<h3>Rejected by reason</h3>{_table_html(_reason_rows(data))}
<h2>Evaluation</h2><p>{html.escape(subset_note(data))}</p>{_table_html(_eval_rows(data))}
<h3>Full evaluation (every val row, downstream tasks)</h3>{_table_html(data["results_table"])}
<h3>Failed evaluations</h3>{_table_html(data["eval_failures"])}
<h3>Train documents removed as contaminated, per evaluation task</h3>{_table_html(data["contaminated_by_task"])}
<h2>Checkpoints</h2>{_table_html(data["checkpoints"])}
<h2>Plots</h2><div class="plots">{figures}</div>{left_out}
</body></html>
"""


def _figure_html(name: str, title: str, png: bytes) -> str:
    wide = ' class="wide"' if name in WIDE_PLOTS else ""
    return (f'<figure{wide}><img alt="{html.escape(title)}" src="data:image/png;base64,{_b64(png)}">'
            f"<figcaption>{html.escape(title)}</figcaption></figure>")


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def _markdown(run_dir: Path, data: dict[str, Any], hidden: dict[str, str]) -> str:
    lines = [f"# tokenmill run {_md_code(run_dir.name)}", "",
             *headline_markdown(data["headline"], _table_md, _md_text),
             "", "## Data funnel", "", *_table_md(data["funnel"]),
             "", "### Rejected by reason", "", *_table_md(_reason_rows(data)),
             "", "## Evaluation", "", _md_text(subset_note(data)), "", *_table_md(_eval_rows(data)),
             "", "### Full evaluation (every val row, downstream tasks)", "", *_table_md(data["results_table"]),
             "", "### Failed evaluations", "", *_table_md(data["eval_failures"]),
             "", "### Train documents removed as contaminated, per evaluation task", "",
             *_table_md(data["contaminated_by_task"]),
             "", "## Plots", ""] + [f"![{title}]({name}.png)" for name, title in PLOTS.items() if name not in hidden]
    lines += [f"- not drawn: {_md_text(PLOTS[name])}: {_md_text(why)}" for name, why in hidden.items()]
    return "\n".join(lines) + "\n"


def _table_md(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["none yet"]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [line([_md_text(str(key)) for key in rows[0]]), line(["---:"] * len(rows[0])),
            *(line([_md_text(_fmt(value)) for value in row.values()]) for row in rows)]


def _md_text(text: str) -> str:
    """``text`` shown as it is in a Markdown table cell: one line, no HTML, no Markdown syntax."""
    flat = " ".join(text.splitlines())
    return html.escape(flat, quote=False).translate(MARKDOWN_SPECIALS)


def _md_code(text: str) -> str:
    """``text`` as one Markdown code span: a backtick fence longer than any backtick run inside it."""
    flat = " ".join(text.splitlines())
    longest = max((len(run) for run in re.findall("`+", flat)), default=0)
    fence = "`" * (longest + 1)
    return f"{fence} {flat} {fence}" if longest else f"`{flat}`"


PLOT_FUNCTIONS = {"loss": _plot_loss, "lr": _plot_lr, "throughput": _plot_throughput, "funnel": _plot_funnel,
                  "source_mix": _plot_source_mix, "doc_lengths": _plot_doc_lengths, "row_fill": _plot_row_fill,
                  "eval_tasks": _plot_eval_tasks, "eval_sources": _plot_eval_sources}
