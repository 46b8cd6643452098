"""The ``preference_pairs`` view: a DPO run's pairs, one row per (pair, kept checkpoint), the checkpoint's log-probs
beside the reference model's and the pair's reward margin.

Columns: ``step``, ``split``, ``source``, ``doc_id`` (the pair's document: its prompt and both completions are
``documents.record``), ``reference_chosen_logp``, ``reference_rejected_logp`` (the reference stage's
``reference/split=S/source=N.parquet``; null where none was stored: ``precompute: false`` or a reference-free loss),
``policy_chosen_logp``, ``policy_rejected_logp`` (the checkpoint's, ``eval/results/step-N/preference_logps.parquet``
from the preference evaluation), ``chosen_tokens``, ``rejected_tokens`` (each completion's loss tokens),
``margin`` = β·((π_c − ref_c) − (π_r − ref_r)), the DPO reward margin, and ``prefers_chosen`` (margin > 0: the pair
counts towards ``rewards/accuracy``). β is the run's ``train.dpo.beta`` from run.yaml (0.1 when it has none), a
number handed to arithmetic, never SQL text. Built only for a statement that names the view.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from core.errors import ConfigError, QueryError
from core.layout import CHECKPOINT_FOLDERS, PREFERENCE_SCORES_FILE, REFERENCE_FILES, STEP_DIR_PATTERN
from core.rundir import RunPaths

PREFERENCE_PAIRS_VIEW = "preference_pairs"
DEFAULT_BETA = 0.1
"""``train.dpo.beta`` when run.yaml has none (trainer.config's default)."""
PREFERENCE_PAIRS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("split", pa.string()), ("source", pa.string()), ("doc_id", pa.int64()),
    ("reference_chosen_logp", pa.float64()), ("reference_rejected_logp", pa.float64()),
    ("policy_chosen_logp", pa.float64()), ("policy_rejected_logp", pa.float64()),
    ("chosen_tokens", pa.int32()), ("rejected_tokens", pa.int32()),
    ("margin", pa.float64()), ("prefers_chosen", pa.bool_()),
])
KEY = ["split", "source", "doc_id"]
SCORE_COLUMNS = ["step", *KEY, "chosen_logp", "rejected_logp", "chosen_tokens", "rejected_tokens"]
REFERENCE_COLUMNS = [*KEY, "chosen_logp", "rejected_logp"]


def score_files(paths: RunPaths) -> list[Path]:
    """Every checkpoint's ``eval/results/step-N/preference_logps.parquet``, in step order."""
    folders = sorted(paths.eval_results.glob(CHECKPOINT_FOLDERS)) if paths.eval_results.is_dir() else []
    return [folder / PREFERENCE_SCORES_FILE for folder in folders
            if STEP_DIR_PATTERN.match(folder.name) and (folder / PREFERENCE_SCORES_FILE).exists()]


def reference_files(paths: RunPaths) -> list[Path]:
    """Every ``reference/split=S/source=N.parquet``."""
    return sorted(paths.reference.glob(REFERENCE_FILES)) if paths.reference.is_dir() else []


def preference_pairs_table(run_dir: Path, scores: list[Path], references: list[Path]) -> pa.Table:
    """The view of the run at ``run_dir`` from its (checked) ``scores`` and ``references`` files; empty without
    scores. QueryError naming the file that is not what the evaluation or the reference stage writes."""
    if not scores:
        return PREFERENCE_PAIRS_SCHEMA.empty_table()
    policy = pa.concat_tables([_read(path, SCORE_COLUMNS) for path in scores])
    reference = (pa.concat_tables([_read(path, REFERENCE_COLUMNS) for path in references]) if references
                 else pa.table({name: pa.array([], type) for name, type in
                                (("split", pa.string()), ("source", pa.string()), ("doc_id", pa.int64()),
                                 ("chosen_logp", pa.float32()), ("rejected_logp", pa.float32()))}))
    reference = reference.rename_columns([*KEY, "reference_chosen_logp", "reference_rejected_logp"])
    policy = policy.rename_columns(["step", *KEY, "policy_chosen_logp", "policy_rejected_logp", "chosen_tokens",
                                    "rejected_tokens"])
    joined = policy.join(reference, keys=KEY, join_type="left outer")
    return _with_margin(joined, _beta(RunPaths(run_dir)))


def _with_margin(joined: pa.Table, beta: float) -> pa.Table:
    def column(name: str) -> pa.ChunkedArray:
        return pc.cast(joined.column(name), pa.float64())

    chosen = pc.subtract(column("policy_chosen_logp"), column("reference_chosen_logp"))
    rejected = pc.subtract(column("policy_rejected_logp"), column("reference_rejected_logp"))
    margin = pc.multiply(pc.subtract(chosen, rejected), beta)
    columns: dict[str, Any] = {name: joined.column(name) for name in PREFERENCE_PAIRS_SCHEMA.names[:-2]}
    columns.update(margin=margin, prefers_chosen=pc.greater(margin, 0.0))
    table = pa.table(columns).cast(PREFERENCE_PAIRS_SCHEMA)
    return table.sort_by([("step", "ascending"), ("split", "ascending"), ("source", "ascending"),
                          ("doc_id", "ascending")])


def _read(path: Path, columns: list[str]) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns).select(columns)
    except (OSError, pa.ArrowException, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise QueryError(f"{path}: not readable as {', '.join(columns)} ({first}); delete it and re-run the stage "
                         "that wrote it (`tokenmill eval` for eval/results, `tokenmill train` for reference/)."
                         ) from None


def _beta(paths: RunPaths) -> float:
    """The run's ``train.dpo.beta`` (run.yaml is data: only a finite number is taken); QueryError otherwise."""
    if not paths.recipe.is_file():
        return DEFAULT_BETA
    # core.config imports pydantic (~0.15 s): only for a statement that names this view, not every query's start
    from core.config import RUN_YAML_FIX, load_yaml_mapping

    try:
        recipe = load_yaml_mapping(paths.recipe, paths.recipe.name, RUN_YAML_FIX)
    except ConfigError as err:
        raise QueryError(str(err)) from None
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    dpo = train.get("dpo") if isinstance(train.get("dpo"), dict) else {}
    beta = dpo.get("beta", DEFAULT_BETA)
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not math.isfinite(beta):
        raise QueryError(f"{paths.recipe}: train.dpo.beta is {beta!r}, not a finite number; `preference_pairs` "
                         "weighs each margin by it: restore run.yaml as the run wrote it.")
    return float(beta)
