"""The run report: ``report/index.html`` (self-contained, opens offline) + ``report.md`` + PNG plots.

It opens on a headline (:mod:`flows.report.headline`), then the tables, then the plots (:mod:`flows.report.plots`)
that carry information (:mod:`flows.report.visibility` says which do not, and the page says why each is left out).

Names and values read from the run dir (sources, reasons, metrics) are text, never markup: HTML-escaped in
the page, escaped in the Markdown, and drawn without mathtext in the plots.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from core.eval_results import failed_results
from core.layout import CHECKPOINT_FOLDERS, CHECKPOINT_MANIFEST, checkpoint_step
from core.rundir import RunPaths, file_stats, fingerprint
from core.stage import Inputs, Progress, Stage, run_stage, stage_status
from flows.report.headline import collect_headline, headline_html, headline_markdown
from flows.report.plots import FIGSIZE, PLOT_FUNCTIONS, PLOTS, render_png
from flows.report.visibility import uninformative_plots
from flows.run_sql import connect
from pipeline.filters.screen import REJECT_REASONS
from pipeline.sql.query import data_funnel, eval_results_table, mix_steps, realised_mix, rejects_by_reason
from trainer.model.sample_generation import sample_is_current, write_sample_generation

MIX_TABLE_TITLE = "Training mix per stage (samples taken per source; mixture / mixture_schedule runs only)"

MARKDOWN_SPECIALS = str.maketrans({char: f"\\{char}" for char in "\\`*[]|"})
"""Backslash-escaped in a Markdown cell: no code span, emphasis, link or image, and no cell break."""


def collect_report_data(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read through the run's SQL views."""
    con = connect(run_dir, trainer_views=False)  # the report shows no trainer view: no replay of every step
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
            "mix_steps": mix_steps(run_dir),
            "realised_mix": realised_mix(run_dir),
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
        data["train_mode"] = data["headline"]["train_mode"]
        return data
    finally:
        con.close()


def write_report(paths: RunPaths) -> Path:
    """Render every plot and write ``report/index.html`` (:class:`ReportStage`); returns its path.

    Skipped when no file it reads changed since it was last written (``stages/report.json``): rendering takes
    ~2 s, and each command of a run that changed nothing (a re-run, ``tokenmill report`` twice) asked for it up
    to three times.
    """
    run_stage(ReportStage(paths))
    return paths.report_page


REPORT_STAGE = "report"


class ReportStage(Stage):
    """The run dir -> ``report/`` (plots, ``report.md``, ``index.html``): the last stage of every command."""

    name = REPORT_STAGE
    reads = ("ingest", "dedupe", "decontaminate", "eval-tasks", "base-model", "tokenizer", "pack", "shard-index",
             "train", "evaluate", "evaluate-pairs")

    def inputs(self, unit: str | None) -> Inputs:
        """Every file of the run dir the report could read, by :func:`core.rundir.file_stats`, one digest per
        top-level entry (``docs``, ``shards``, ``stages``, …: a stale report names what changed).

        That is every file but ``report/``, the lock, the report's own marker, the commands' seals (written after
        the report), ``metrics/stage_times.jsonl`` (it grows with every stage call, skipped ones included, so
        counting it would re-render the report on every re-run; a stage call that did work also changed the
        files it wrote) and the sample generation (the report's own, see :meth:`changed_since`). 7 ms on the
        quick start's run.
        """
        paths = self.paths
        skipped = frozenset({paths.report, paths.lock_file, paths.marker(REPORT_STAGE), paths.stage_times,
                             paths.seals, paths.sample_generation})
        entries = sorted(paths.root.iterdir()) if paths.root.is_dir() else []
        stats = {entry.name: file_stats(paths.root, entry, skipped) for entry in entries if entry not in skipped}
        return Inputs(files={name: fingerprint(found) for name, found in stats.items() if found})  # stages/: its own

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.report_page]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """The sample generation, when the export is newer than it (a new export is sampled once)."""
        return [] if sample_is_current(self.paths) else [self.paths.sample_generation]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        paths, index = self.paths, self.paths.report_page
        if not sample_is_current(paths):  # a new export: sample it once (imports torch), the report reads the file
            write_sample_generation(paths)
        data = collect_report_data(paths.root)
        hidden = uninformative_plots(data)
        images = {name: render_png(PLOT_FUNCTIONS[name], data, FIGSIZE.get(name, (7, 3.6))) for name in PLOTS
                  if name not in hidden}
        for name in PLOTS:
            if name in images:
                paths.write_bytes(paths.report_plot(name), images[name])
            else:  # a plot drawn by an earlier report: it would contradict this one
                (paths.report_plot(name)).unlink(missing_ok=True)
        paths.write_text(paths.report_markdown, _markdown(paths.root, data, hidden))
        paths.write_text(index, _html(paths.root, data, images, hidden))
        return {"index": index.relative_to(paths.root).as_posix()}


def report_is_current(paths: RunPaths) -> bool:
    """Whether ``report/index.html`` exists, no file it reads changed since it was written, and the export (if
    any) has its sample generation."""
    return stage_status(ReportStage(paths)).state == "done"


def report_inputs_fingerprint(paths: RunPaths) -> str:
    """The fingerprint :class:`ReportStage` records for the run dir as it is now."""
    return ReportStage(paths).inputs(None).fingerprint()


def _checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for folder in sorted(RunPaths(run_dir).checkpoints.glob(CHECKPOINT_FOLDERS)):
        if folder.is_dir() and (step := checkpoint_step(folder)) is not None:
            size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
            found.append({"checkpoint": folder.name, "step": step,
                          "complete": (folder / CHECKPOINT_MANIFEST).is_file(), "size_mb": round(size / 1e6, 2)})
    return found


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
{f"<h2>{MIX_TABLE_TITLE}</h2>{_table_html(data['realised_mix'])}" if data["realised_mix"] else ""}
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
             *(["", f"## {MIX_TABLE_TITLE}", "", *_table_md(data["realised_mix"])] if data["realised_mix"] else []),
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


