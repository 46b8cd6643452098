"""Training history: each launch's loader setup -> ``metrics/train_segments.jsonl``; row losses -> ``row_losses/``.

The data order is a pure function of the loader's setup, so a launch records that setup once (one line, rank 0,
before its first step) instead of logging rows per step: start step, start sample, batch layout, seed, the
mixture section, the loader state and the train shards in index order. :mod:`trainer.metrics.consumed` replays the
launches through the loader's own order code to answer "which rows did step N train on". With
``train.log_row_losses`` each data-parallel rank also appends, per step, the mean loss of each of its rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.rundir import RunPaths
from trainer.loader.batches import TrainLoader
from trainer.model.llama import IGNORE_INDEX, next_token_loss

SEGMENT_VERSION = 1


def segments_path(paths: RunPaths) -> Path:
    """``metrics/train_segments.jsonl``: one line per training launch."""
    return paths.train_segments


def read_segments(path: Path) -> list[dict[str, Any]]:
    """The launches recorded in ``path`` (none when absent); a torn or foreign line is skipped."""
    if not path.is_file():
        return []
    segments = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("version") == SEGMENT_VERSION:
            segments.append(row)
    return segments


def segment_record(loader: TrainLoader, start_step: int, num_processes: int,
                   mixture_sections: dict[str, Any]) -> dict[str, Any]:
    """What re-deriving this launch's data order needs (``mixture_sections``: run.yaml's ``mixture`` and
    ``mixture_schedule`` as the trainer validated them, as JSON)."""
    rows, layout = loader.rows, loader.layout
    return {"version": SEGMENT_VERSION, "start_step": start_step, "start_sample": loader.samples_consumed,
            "num_processes": num_processes, "world_size": layout.world_size,
            "micro_batch_size": layout.micro_batch_size, "grad_accum_steps": layout.grad_accum_steps,
            "seed": loader.seed, **mixture_sections, "loader_state": loader.state_dict(),
            "shards": [{"path": path, "source": source, "num_rows": int(hi - lo), "sha256": rows.digests[path]}
                       for path, source, lo, hi in zip(rows.shard_paths, rows.shard_sources, rows.starts[:-1],
                                                       rows.starts[1:], strict=True)]}


def append_segment(paths: RunPaths, record: dict[str, Any]) -> int:
    """Add ``record`` as the newest launch and return its number (0 = the first).

    The file is rewritten whole, atomically (a few lines, once per launch): a torn line a killed writer left is
    dropped rather than glued to the new one.
    """
    path = segments_path(paths)
    segments = read_segments(path)
    segments.append({**record, "segment": len(segments)})
    paths.write_text(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in segments))
    return len(segments) - 1


def row_losses_path(paths: RunPaths, segment: int, rank: int) -> Path:
    """One file per launch and data-parallel rank: a new launch never appends to a torn line."""
    return paths.row_losses_file(segment, rank)


def row_mean_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's mean next-token loss, float32 [rows]; NaN for a row with no target token (all padding).

    Same cross-entropy as the training loss (:func:`trainer.model.llama.next_token_loss`), from the same logits,
    detached: the training maths is unchanged. Row by row, so the float32 copy it makes is one row's logits,
    not the micro-batch's (which the training loss already holds once).
    """
    with torch.no_grad():
        sums = torch.stack([next_token_loss(logits[row:row + 1].detach(), labels[row:row + 1], reduction="none").sum()
                            for row in range(labels.shape[0])])
        counted = (torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX).sum(dim=1)
        return (sums / counted).float().cpu()


class RowLossLog:
    """Appends one line per step with this rank's row losses: ``{"step", "sample", "micro_batch_size", "losses"}``.

    ``sample`` is the global sample number of the rank's first row in the step; ``losses`` its rows in order
    (micro-batch by micro-batch). Flushed per line: a kill -9 leaves at most a torn last line, which readers skip.
    """

    def __init__(self, paths: RunPaths, segment: int, rank: int, micro_batch_size: int) -> None:
        self.paths, self.path, self.micro_batch_size = paths, row_losses_path(paths, segment, rank), micro_batch_size

    def write(self, step: int, first_sample: int, losses: list[torch.Tensor]) -> None:
        values = np.concatenate([loss.numpy() for loss in losses]) if losses else np.zeros(0, dtype=np.float32)
        rounded = [None if not np.isfinite(value) else float(f"{value:.7g}") for value in values.tolist()]
        line = {"step": step, "sample": first_sample, "micro_batch_size": self.micro_batch_size, "losses": rounded}
        self.paths.append_text(self.path, json.dumps(line) + "\n")
