"""What each step saw: ``metrics/train_segments.jsonl`` + ``train.jsonl`` -> the ``consumed``, ``row_losses`` tables.

Nothing here logs or re-implements the order: each recorded launch is replayed through the loader itself
(:meth:`trainer.loader.batches.TrainLoader.next_steps_rows`, with the mixture the trainer builds), over the shard list
the launch recorded, without reading a token. A launch's steps survive up to the step the next launch resumed from
(a kill -9 replays the steps after the newest checkpoint, on whatever number of processes the resume has); the
last launch's, up to the newest step in train_metrics or the checkpoints. Spike-guard skips and rollbacks come
from the train_metrics rows that record them. ``flows.run_sql`` registers both tables as DuckDB views.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from core.errors import QueryError, TokenmillError
from core.rundir import RunPaths, path_inside_run
from core.schemas import CONSUMED_SCHEMA, ROW_LOSSES_SCHEMA
from trainer.checkpoint.layout import MANIFEST_NAME, list_checkpoints
from trainer.loader.batches import BatchLayout, ShardNumbering, TrainLoader
from trainer.metrics.segments import read_segments, segments_path
from trainer.metrics.sink import read_metric_rows

ROW_LOSSES_NAME = re.compile(r"^segment-(\d{5})-rank-(\d{5})\.jsonl$")
CHUNK_SAMPLES = 1 << 20
"""Samples replayed per call to the loader: bounds the memory of the arrays behind one record batch."""


@dataclass(frozen=True)
class Launch:
    """One recorded launch and the steps of it that survive (``first_step .. last_step``; none when first > last)."""

    record: dict[str, Any]
    first_step: int
    last_step: int


def surviving_launches(paths: RunPaths) -> list[Launch]:
    """Each recorded launch with the steps no later launch replaced."""
    segments = read_segments(_checked(paths, segments_path(paths)))
    last_step = _newest_step(paths, segments)
    launches = []
    for number, record in enumerate(segments):
        later = [int(other["start_step"]) for other in segments[number + 1:]]
        launches.append(Launch(record, int(record["start_step"]) + 1, min(later) if later else last_step))
    return launches


def consumed_table(run_dir: Path) -> pa.Table:
    """``consumed``: the rows every surviving step trained on (columns: CONSUMED_SCHEMA). QueryError names a
    history file that cannot be replayed."""
    paths = RunPaths(run_dir)
    launches = surviving_launches(paths)
    spikes, rolled_back = _guard_events(paths)
    batches = []
    for launch in launches:
        try:
            batches.extend(_replay(launch, spikes, rolled_back))
        except (KeyError, TypeError, ValueError, TokenmillError) as err:
            raise QueryError(f"{segments_path(paths)}: launch {launch.record.get('segment')} cannot be replayed "
                             f"({type(err).__name__}: {err}); the file was edited or damaged: restore it, or delete "
                             "the line to leave that launch's steps out of `consumed`.") from None
    return pa.Table.from_batches(batches, schema=CONSUMED_SCHEMA)


def _replay(launch: Launch, spikes: set[int], rolled_back: list[tuple[int, int]]) -> list[pa.RecordBatch]:
    """The launch's surviving steps, read off a loader set up as the launch set its own up."""
    # The trainer's own mixture construction, from the section as the trainer validates it (train.py imports
    # everything this module does, and the trainer never imports this module).
    from trainer.train import MIXTURE_SECTIONS, TrainerSections, build_mixture  # imports torch: only for this view

    record = launch.record
    shards = record["shards"]
    numbering = ShardNumbering([s["path"] for s in shards], [s["source"] for s in shards],
                               [int(s["num_rows"]) for s in shards], {s["path"]: s["sha256"] for s in shards})
    layout = BatchLayout(int(record["micro_batch_size"]), int(record["grad_accum_steps"]), int(record["world_size"]))
    seed = int(record["seed"])
    sections = TrainerSections.model_validate({key: record.get(key) for key in MIXTURE_SECTIONS})
    with warnings.catch_warnings():  # the launch itself warned (weights, changed batches or data, dropped sources)
        warnings.simplefilter("ignore")
        mixture = build_mixture(numbering, sections.mixture, seed, sections.mixture_schedule)
        loader = TrainLoader(numbering, layout, seed, allow_data_change=True, mixture=mixture)
        if mixture is not None:
            mixture.warn = False
        loader.load_state_dict(record["loader_state"])
    paths = pa.array(numbering.shard_paths, pa.string())
    sources = pa.array(numbering.shard_sources, pa.string())
    per_step = layout.global_batch_size
    per_rank = per_step // layout.world_size
    steps_per_chunk = max(1, CHUNK_SAMPLES // per_step)
    batches = []
    for first in range(launch.first_step, launch.last_step + 1, steps_per_chunk):
        num_steps = min(steps_per_chunk, launch.last_step + 1 - first)
        start_sample = loader.samples_consumed
        rows = loader.next_steps_rows(num_steps).ravel()
        offset = np.arange(len(rows), dtype=np.int64)
        within_rank = offset % per_rank
        step = first + offset // per_step
        sample = start_sample + offset
        shard_ids, row_in_shard = numbering.locate(rows)
        shard_ids = pa.array(shard_ids.astype(np.int32))
        batches.append(pa.RecordBatch.from_arrays([
            pa.array(step), pa.array((within_rank // layout.micro_batch_size).astype(np.int32)),
            pa.array(((offset % per_step) // per_rank).astype(np.int32)),
            pa.array((within_rank % layout.micro_batch_size).astype(np.int32)), pa.array(sample),
            pa.DictionaryArray.from_arrays(shard_ids, paths).cast(pa.string()), pa.array(row_in_shard),
            pa.DictionaryArray.from_arrays(shard_ids, sources).cast(pa.string()),
            pa.array(np.full(len(rows), int(record["segment"]), dtype=np.int32)),
            pa.array(np.isin(step, np.fromiter(spikes, dtype=np.int64, count=len(spikes)))),
            pa.array(_in_ranges(sample, rolled_back))], schema=CONSUMED_SCHEMA))
    return batches


def _in_ranges(values: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    inside = np.zeros(len(values), dtype=bool)
    for lo, hi in ranges:
        inside |= (values >= lo) & (values < hi)
    return inside


def _guard_events(paths: RunPaths) -> tuple[set[int], list[tuple[int, int]]]:
    """(steps skipped as loss spikes, half-open sample ranges a rollback undid) from train_metrics."""
    rows = _train_rows(paths)
    spikes = {int(row["step"]) for row in rows if row.get("spike_z_score") is not None}
    ranges = [(int(row["samples_skipped_from"]), int(row["samples_skipped_to"])) for row in rows
              if row.get("samples_skipped_from") is not None and row.get("samples_skipped_to") is not None]
    return spikes, ranges


def _train_rows(paths: RunPaths) -> list[dict[str, Any]]:
    path = paths.train_metrics
    return read_metric_rows(_checked(paths, path)) if path.exists() else []


def _newest_step(paths: RunPaths, segments: list[dict[str, Any]]) -> int:
    """The newest step the run is known to have reached: train_metrics rows, complete checkpoints, launch starts."""
    steps = [int(row["step"]) for row in _train_rows(paths) if isinstance(row.get("step"), int)]
    steps += [step for step, folder in list_checkpoints(paths.checkpoints) if (folder / MANIFEST_NAME).is_file()]
    steps += [int(record["start_step"]) for record in segments]
    return max(steps, default=0)


def row_losses_table(run_dir: Path) -> pa.Table:
    """``row_losses``: each surviving step's per-row losses (columns: ROW_LOSSES_SCHEMA); torn lines are skipped."""
    paths = RunPaths(run_dir)
    folder = paths.row_losses
    launches = {int(launch.record["segment"]): launch for launch in surviving_launches(paths)}
    columns: dict[str, list[Any]] = {name: [] for name in ROW_LOSSES_SCHEMA.names}
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    for path in files:
        match = ROW_LOSSES_NAME.match(path.name)
        launch = launches.get(int(match.group(1))) if match else None
        if launch is None:
            continue
        for line in _checked(paths, path).read_text(encoding="utf-8", errors="replace").splitlines():
            _add_row_losses(columns, line, launch, int(match.group(2)))
    return pa.Table.from_pydict(columns, schema=ROW_LOSSES_SCHEMA)


def _add_row_losses(columns: dict[str, list[Any]], line: str, launch: Launch, rank: int) -> None:
    try:
        row = json.loads(line)
        step, sample, size, losses = int(row["step"]), int(row["sample"]), int(row["micro_batch_size"]), row["losses"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return  # a torn last line (the writer was killed mid-write)
    if not isinstance(losses, list) or not launch.first_step <= step <= launch.last_step or size < 1:
        return  # a foreign line, or a step a later launch replaced
    losses = [float(loss) if isinstance(loss, int | float) and not isinstance(loss, bool) else None for loss in losses]
    for index, loss in enumerate(losses):
        for name, value in (("step", step), ("micro_step", index // size), ("rank", rank),
                            ("batch_row", index % size), ("sample", sample + index), ("loss", loss),
                            ("segment", int(launch.record["segment"]))):
            columns[name].append(value)


def _checked(paths: RunPaths, path: Path) -> Path:
    """``path`` when absent or a regular file inside the run dir; QueryError otherwise."""
    present = path.exists() or path.is_symlink()
    if present and not (path_inside_run(paths.root, path) and path.is_file()):
        raise QueryError(f"{path}: not a regular file inside the run dir {paths.root}; replace it by the file "
                         "tokenmill wrote, or remove it.")
    return path
