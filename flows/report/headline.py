"""The report's headline: what the run reached and what it cost, read from the run's tables and files.

Final validation loss and bits per byte (a DPO run: the val pairs' DPO loss and reward accuracy; an SFT run's loss
labelled with the tokens it is over), parameters, tokens trained, tokens per character and vocabulary use,
wall time per stage, a sample generation, the recipe and the package versions. Every value is read, none
computed by running a model: the sample comes from ``metrics/sample_generation.json``
(:mod:`trainer.model.sample_generation`), made once per export.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow.compute as pc
import yaml
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from core.eval_results import PREFERENCE_TASK
from core.rundir import RunPaths, path_inside_run
from flows.report.preference_plots import ACCURACY
from flows.stage_times import read_versions, stage_wall_times
from trainer.eval.run_mode import DPO_MODE, SFT_MODE, scored_tokens
from trainer.model.sample_generation import read_sample

FINAL_VAL_LOSS = "final val loss"
"""The whole val split's loss (the full evaluation), as the run summary's ``final_val_loss`` is."""
SUBSET_VAL_LOSS = "val loss (in-loop subset)"
"""What the headline shows without a full evaluation: the training loop's fixed subset, never "final"."""
FINAL_DPO_LOSS = "final val DPO loss"
"""A DPO run's headline: the sigmoid DPO loss (or SimPO's) of every val pair, from the full evaluation."""
SUBSET_DPO_LOSS = "val DPO loss (in-loop subset)"
VOCAB_BATCH_ROWS = 8192
"""Packed rows per batch while counting token ids: memory stays bounded by one batch (seq_len x this)."""


def collect_headline(paths: RunPaths, con: duckdb.DuckDBPyConnection, data: dict[str, Any]) -> dict[str, Any]:
    """The headline's values; ``data`` is the report's (its ``train``, ``eval`` and ``results`` rows)."""
    recipe = paths.recipe.read_text(encoding="utf-8", errors="replace") if readable(paths, paths.recipe) else None
    train = recorded_train(recipe)
    return {
        "train_mode": train[0],
        "val": final_val(data, train),
        "num_parameters": exported_parameters(paths),
        "tokens_trained": _last(data["train"], "tokens_seen"),
        "tokens_per_char": con.sql(
            "SELECT (SELECT sum(num_tokens) FROM shards)::DOUBLE / nullif((SELECT sum(num_chars) FROM documents), 0)"
        ).fetchall()[0][0],
        "vocab": vocab_use(paths, con),
        "stage_times": stage_wall_times(paths),
        "versions": read_versions(paths),
        "recipe": recipe,
        "sample": read_sample(paths),
    }


def recorded_train(recipe: str | None) -> tuple[str, str | None]:
    """``(train.mode, what an SFT run's loss is over)`` of run.yaml's text, read as data: only a known mode or
    label comes back (``pretrain`` for anything else, or a recipe that does not parse)."""
    try:
        loaded = yaml.safe_load(recipe) if recipe else None
    except yaml.YAMLError:
        loaded = None
    loaded = loaded if isinstance(loaded, dict) else {}
    train = loaded.get("train") if isinstance(loaded.get("train"), dict) else {}
    mode = train.get("mode") if train.get("mode") in (SFT_MODE, DPO_MODE) else "pretrain"
    return mode, scored_tokens(loaded) if mode == SFT_MODE else None


def final_val(data: dict[str, Any], train: tuple[str, str | None] = ("pretrain", None)) -> dict[str, Any]:
    """The headline's validation figures for the run's ``train`` (:func:`recorded_train`): a DPO run's DPO loss
    and reward accuracy (:func:`_final_preference`); else the loss and bits per byte, labelled with the tokens an
    SFT run's loss is over."""
    mode, scored = train
    if mode == DPO_MODE:
        return _final_preference(data)
    val = _final_val(data)
    if scored is not None:
        val["label"] = f"{val['label']}, {scored} tokens"
    return val


def _final_preference(data: dict[str, Any]) -> dict[str, Any]:
    """The val pairs' DPO loss and reward accuracy of the newest full evaluation (``preference`` results), else
    of the in-loop one (its ``val_loss`` is the DPO loss of a fixed subset of the val pairs)."""
    full: dict[str, dict[str, Any]] = {}
    for row in data["results"]:  # ordered by step: the newest step's value wins
        if row["task"] == PREFERENCE_TASK and row["source"] is None and row["value"] is not None:
            full[row["metric"]] = row
    if "loss" in full:
        step = full["loss"]["step"]
        return {"loss": full["loss"]["value"], "accuracy": full.get(ACCURACY, {}).get("value"), "step": step,
                "label": FINAL_DPO_LOSS, "note": f"every val pair, step {step}"}
    last = data["eval"][-1] if data["eval"] else {}
    if last.get("val_loss") is None:
        return {"loss": None, "accuracy": None, "step": None, "label": FINAL_DPO_LOSS, "note": "no evaluation yet"}
    return {"loss": last["val_loss"], "accuracy": last.get(ACCURACY), "step": last["step"],
            "label": SUBSET_DPO_LOSS, "note": f"in-loop subset of the val pairs, step {last['step']}"}


def _final_val(data: dict[str, Any]) -> dict[str, Any]:
    """Loss and bits per byte of the newest full evaluation (the whole val split: the "final val loss"), else of
    the in-loop one, labelled as the subset of the split it is (bits per byte only with a byte count)."""
    full: dict[str, dict[str, Any]] = {}
    for row in data["results"]:  # ordered by step: the newest step's value wins
        if row["task"] == "val_split" and row["source"] is None and row["value"] is not None:
            full[row["metric"]] = row
    last = data["eval"][-1] if data["eval"] else {}
    if "loss" in full:
        step = full["loss"]["step"]
        bpb = full.get("bits_per_byte", {}).get("value")
        return {"loss": full["loss"]["value"], "bpb": bpb, "step": step, "label": FINAL_VAL_LOSS,
                "note": f"whole val split, step {step}"}
    if last.get("val_loss") is None:
        return {"loss": None, "bpb": None, "step": None, "label": FINAL_VAL_LOSS, "note": "no evaluation yet"}
    return {"loss": last["val_loss"], "bpb": last.get("val_bpb"), "step": last["step"], "label": SUBSET_VAL_LOSS,
            "note": f"in-loop subset, step {last['step']}; the whole split needs the full evaluation"}


def _last(rows: list[dict[str, Any]], key: str) -> Any:
    values = [row[key] for row in rows if row.get(key) is not None]
    return values[-1] if values else None


def exported_parameters(paths: RunPaths) -> int | None:
    """Parameters of the exported model, from its safetensors headers (no weights read; tied ones once, as
    the export stores them); None before an export, or when a header does not read (the sample says why)."""
    files = sorted(paths.model.glob("*.safetensors")) if paths.model.is_dir() else []
    if not files or not all(readable(paths, path) for path in files):
        return None
    total = 0
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as weights:
                total += sum(int(np.prod(weights.get_slice(name).get_shape())) for name in weights.keys())  # noqa: SIM118
        except SafetensorError:
            return None
    return total


def vocab_use(paths: RunPaths, con: duckdb.DuckDBPyConnection) -> dict[str, int] | None:
    """``{used, size}``: token ids that occur among the train rows' real tokens (padding left out), of the
    tokenizer's vocabulary; None without train shards or a tokenizer."""
    size = _vocab_size(paths)
    if size is None:
        return None
    seen = np.zeros(size, dtype=bool)
    reader = con.sql("SELECT input_ids, num_tokens FROM sequences WHERE split = 'train'").to_arrow_reader(
        VOCAB_BATCH_ROWS)
    num_rows = 0
    for batch in reader:
        if not batch.num_rows:
            continue
        num_rows += batch.num_rows
        ids = pc.list_flatten(batch.column("input_ids")).to_numpy().reshape(batch.num_rows, -1)
        real = np.arange(ids.shape[1]) < batch.column("num_tokens").to_numpy()[:, None]
        used = ids[real]
        seen[used[used < size]] = True
    return {"used": int(seen.sum()), "size": size} if num_rows else None


def _vocab_size(paths: RunPaths) -> int | None:
    if not readable(paths, paths.tokenizer):
        return None

    return Tokenizer.from_file(str(paths.tokenizer)).get_vocab_size()


def readable(paths: RunPaths, path: Path) -> bool:
    """``path`` is a file that stays inside the run dir, every symlink followed: a run dir is data from whoever
    made it, and the report shows what it reads."""
    return path.is_file() and path_inside_run(paths.root, path)


# ---- rendering -----------------------------------------------------------------------------------------


def headline_figures(headline: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(label, value, note)`` of the key figures, as text; ``—`` where the run has no value yet."""
    val, vocab = headline["val"], headline["vocab"]
    if "accuracy" in val:  # a DPO run
        second = ("reward accuracy", "—" if val["accuracy"] is None else f"{val['accuracy']:.1%}",
                  "val pairs whose chosen reward is the higher" if val["accuracy"] is not None else
                  "not recorded (needs stored reference log-probs)")
    else:
        second = ("bits per byte", _number(val["bpb"], ".4f"), val["note"] if val["bpb"] is not None else
                  "needs the full evaluation (eval section)")
    return [
        (val["label"], _number(val["loss"], ".4f"), val["note"]),
        second,
        ("parameters", _number(headline["num_parameters"], ","), "exported model" if headline["num_parameters"]
         else "no export yet"),
        ("tokens trained", _number(headline["tokens_trained"], ","), "padding included"),
        ("tokens per character", _number(headline["tokens_per_char"], ".3f"), "all shards / kept documents"),
        ("vocab use", f"{vocab['used'] / vocab['size']:.1%}" if vocab else "—",
         f"{vocab['used']:,} of {vocab['size']:,} ids in the train rows" if vocab else "no train shards yet"),
    ]


def _number(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def stage_rows(headline: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"stage": row["stage"], "wall time": _duration(row["wall_s"]), "calls": row["calls"]}
            for row in headline["stage_times"]]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    return f"{int(minutes)} min {secs:.0f} s" if minutes else f"{secs:.2f} s"


def versions_line(headline: dict[str, Any]) -> str:
    return " · ".join(f"{name} {value}" for name, value in headline["versions"].items()) or "not recorded yet"


def headline_html(headline: dict[str, Any], table_html: Any) -> str:
    """The headline section; ``table_html`` renders a list of row dicts (the report's own table helper)."""
    cards = "".join(f'<div class="card"><div class="label">{html.escape(label)}</div>'
                    f'<div class="value">{html.escape(value)}</div><div class="note">{html.escape(note)}</div></div>'
                    for label, value, note in headline_figures(headline))
    recipe = ("<p>none yet</p>" if headline["recipe"] is None else
              f"<details><summary>run.yaml</summary><pre>{html.escape(headline['recipe'])}</pre></details>")
    return (f'<section class="headline"><div class="cards">{cards}</div>'
            f'<div class="columns"><div><h3>Sample generation</h3>{_sample_html(headline["sample"])}</div>'
            f"<div><h3>Wall time per stage</h3>{table_html(stage_rows(headline))}</div></div>"
            f"<h3>Recipe and versions</h3><p>{html.escape(versions_line(headline))}</p>{recipe}</section>")


def _sample_html(sample: dict[str, Any] | None) -> str:
    if sample is None:
        return "<p>none yet (made from the exported model after training)</p>"
    if "error" in sample:
        return f"<p>the exported model did not load: {html.escape(sample['error'])}</p>"
    settings = (f"temperature {sample['temperature']}, top-k {sample['top_k']}, seed {sample['seed']}, "
                f"at most {sample['max_new_tokens']} tokens; the prompt (bold) is the first line of a val document")
    return (f'<pre class="sample"><b>{html.escape(sample["prompt"])}</b>{html.escape(sample["completion"])}</pre>'
            f'<p class="note">{html.escape(settings)}</p>')


def headline_markdown(headline: dict[str, Any], table_md: Any, md_text: Any) -> list[str]:
    """The headline as Markdown lines; ``table_md`` and ``md_text`` are the report's escaping helpers."""
    figures = [{"figure": label, "value": value, "note": note} for label, value, note in headline_figures(headline)]
    sample = headline["sample"]
    if sample is None or "error" in sample:
        sample_lines = [md_text(sample["error"] if sample else "none yet")]
    else:  # a fenced block shows the text as it is: no backtick run inside can close a longer fence
        text = sample["prompt"] + sample["completion"]
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
        sample_lines = [fence, text, fence]
    return [*table_md(figures), "", "### Sample generation", "", *sample_lines, "", "### Wall time per stage", "",
            *table_md(stage_rows(headline)), "", "### Versions", "", md_text(versions_line(headline))]
