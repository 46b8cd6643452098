"""The run report: ``report/index.html`` (self-contained, opens offline) + ``report.md`` + PNG plots."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.atomic import write_bytes_atomic, write_text_atomic
from pipeline.queries import data_funnel
from pipeline.query import connect

PLOTS: dict[str, str] = {
    "loss": "Training and validation loss",
    "lr": "Learning rate",
    "throughput": "Throughput and MFU",
    "funnel": "Data funnel per source",
    "source_mix": "Source mix (documents and tokens)",
    "doc_lengths": "Document length (characters)",
    "row_fill": "Row fill (real tokens per packed row)",
}


def collect_report_data(run_dir: Path) -> dict[str, Any]:
    """Everything the report shows, read through the run's SQL views."""
    con = connect(run_dir)
    try:
        def rows(sql: str) -> list[dict[str, Any]]:
            return con.sql(sql).to_arrow_table().to_pylist()

        return {
            "train": rows("SELECT * FROM train_metrics ORDER BY step"),
            "eval": rows("SELECT * FROM eval_metrics ORDER BY step"),
            "funnel": data_funnel(run_dir),
            "mix": rows("SELECT d.source, d.docs, coalesce(t.tokens, 0) AS tokens FROM "
                        "(SELECT source, count(*) AS docs FROM documents GROUP BY source) d LEFT JOIN "
                        "(SELECT source, sum(num_tokens) AS tokens FROM shards GROUP BY source) t USING (source) "
                        "ORDER BY d.source"),
            "doc_lengths": [r["num_chars"] for r in rows("SELECT num_chars FROM documents")],
            "row_fill": [r["num_tokens"] for r in rows("SELECT num_tokens FROM sequences")],
            "checkpoints": _checkpoints(run_dir),
        }
    finally:
        con.close()


def write_report(run_dir: str | Path) -> Path:
    """Render every plot and write ``report/index.html``; returns its path."""
    run_dir = Path(run_dir)
    data = collect_report_data(run_dir)
    images = {name: _render(PLOT_FUNCTIONS[name], data) for name in PLOTS}
    report_dir = run_dir / "report"
    for name, png in images.items():
        write_bytes_atomic(report_dir / f"{name}.png", png)
    write_text_atomic(report_dir / "report.md", _markdown(run_dir, data))
    index = report_dir / "index.html"
    write_text_atomic(index, _html(run_dir, data, images))
    return index


def _checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for folder in sorted((run_dir / "checkpoints").glob("step-*")):
        if folder.is_dir() and folder.name[5:].isdigit():
            size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
            found.append({"checkpoint": folder.name, "step": int(folder.name[5:]),
                          "complete": (folder / "manifest.json").is_file(), "size_mb": round(size / 1e6, 2)})
    return found


def _render(plot: Callable[[Any, dict[str, Any]], None], data: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=100)
    try:
        plot(axes, data)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        return buffer.getvalue()
    finally:
        plt.close(figure)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[Any], list[Any]]:
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _plot_loss(axes: Any, data: dict[str, Any]) -> None:
    axes.plot(*_series(data["train"], "loss"), label="train loss")
    axes.plot(*_series(data["eval"], "val_loss"), marker="o", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/token)")
    tokens_per_step = _tokens_per_step(data["train"])
    if tokens_per_step:
        top = axes.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step, lambda t: t / tokens_per_step))
        top.set_xlabel("tokens seen")
    axes.legend()


def _tokens_per_step(train: list[dict[str, Any]]) -> float | None:
    last = next((row for row in reversed(train) if row.get("tokens_seen") and row.get("step")), None)
    return None if last is None else last["tokens_seen"] / last["step"]


def _plot_lr(axes: Any, data: dict[str, Any]) -> None:
    axes.plot(*_series(data["train"], "lr"))
    axes.set_xlabel("step")
    axes.set_ylabel("learning rate")


def _plot_throughput(axes: Any, data: dict[str, Any]) -> None:
    axes.plot(*_series(data["train"], "tokens_per_s"), label="tokens/s")
    axes.set_xlabel("step")
    axes.set_ylabel("tokens/s")
    steps, mfu = _series(data["train"], "mfu")
    if mfu:
        twin = axes.twinx()
        twin.plot(steps, [100 * value for value in mfu], color="tab:orange", label="MFU %")
        twin.set_ylabel("MFU (%)")


def _plot_funnel(axes: Any, data: dict[str, Any]) -> None:
    stages = ["records_read", "rejected", "exact_duplicates", "near_duplicates", "contaminated", "kept"]
    width = 0.8 / max(1, len(data["funnel"]))
    for offset, row in enumerate(data["funnel"]):
        axes.bar([i + offset * width for i in range(len(stages))], [row[s] for s in stages], width, label=row["source"])
    axes.set_xticks(range(len(stages)), ["read", "rejected", "exact dups", "near dups", "contaminated", "kept"])
    axes.set_yscale("symlog")  # rejects and duplicates are often 1% of what was read: keep them visible
    axes.set_ylabel("records")
    axes.legend()


def _plot_source_mix(axes: Any, data: dict[str, Any]) -> None:
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
    axes.hist(data["doc_lengths"] or [0], bins=50, log=True)
    axes.set_xlabel("characters per document")
    axes.set_ylabel("documents")


def _plot_row_fill(axes: Any, data: dict[str, Any]) -> None:
    axes.hist(data["row_fill"] or [0], bins=40)
    axes.set_xlabel("real tokens in the row")
    axes.set_ylabel("rows")


PLOT_FUNCTIONS = {"loss": _plot_loss, "lr": _plot_lr, "throughput": _plot_throughput, "funnel": _plot_funnel,
                  "source_mix": _plot_source_mix, "doc_lengths": _plot_doc_lengths, "row_fill": _plot_row_fill}


def _table_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>none yet</p>"
    head = "".join(f"<th>{html.escape(str(key))}</th>" for key in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row.values()) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _eval_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"step": r["step"], "val_loss": r.get("val_loss"), "val_ppl": r.get("val_ppl")} for r in data["eval"]]


def _html(run_dir: Path, data: dict[str, Any], images: dict[str, bytes]) -> str:
    figures = "".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{_b64(images[name])}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
        for name, title in PLOTS.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tokenmill run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}figure{{display:inline-block;margin:.5em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>tokenmill run <code>{html.escape(run_dir.name)}</code></h1>
<h2>Data funnel</h2>{_table_html(data["funnel"])}
<h2>Evaluation</h2>{_table_html(_eval_rows(data))}
<h2>Checkpoints</h2>{_table_html(data["checkpoints"])}
<h2>Plots</h2>{figures}
</body></html>
"""


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def _markdown(run_dir: Path, data: dict[str, Any]) -> str:
    lines = [f"# tokenmill run `{run_dir.name}`", "", "## Evaluation", "", "| step | val_loss | val_ppl |",
             "|---:|---:|---:|"]
    lines += [f"| {r['step']} | {_fmt(r['val_loss'])} | {_fmt(r['val_ppl'])} |" for r in _eval_rows(data)]
    lines += ["", "## Plots", ""] + [f"![{title}]({name}.png)" for name, title in PLOTS.items()]
    return "\n".join(lines) + "\n"
