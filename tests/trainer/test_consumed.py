"""trainer/metrics/consumed.py, segments.py: the ``consumed`` view equals the rows the loader yielded, across a kill -9
and a 2 -> 1 process resume; ``row_losses`` covers the same rows and leaves training bitwise unchanged.

What was yielded comes from the loader's test hook (``TOKENMILL_TEST_YIELDED_ROWS``): each rank appends the row
numbers it loaded, per step. The expected step of each record is worked out here from the launch's batch size and
the checkpoint it resumed from, independently of the segment replay.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from core.errors import QueryError
from core.shards.store import read_shard_index
from flows.run_sql import run_query
from tests.trainer.conftest import MakeRunDir, edit_recipe, exported_weights
from tests.trainer.test_resume import wait_for_step
from trainer.loader.batches import YIELDED_ROWS_HOOK
from trainer.metrics.sink import read_metric_rows
from trainer.parallel.launch import launch_command
from trainer.train import main

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 16
SETTINGS = {"max_steps": MAX_STEPS, "checkpoint_every": 4, "eval_every": 100, "eval_batches": 1, "log_every": 1,
            "micro_batch_size": 2, "grad_accum_steps": 2, "log_row_losses": True}
"""2 ranks x 2 micro-batches x 2 rows = 8 samples a step, then 4 on one process."""
COLUMNS = ("step", "micro_step", "rank", "batch_row", "sample", "shard_path", "row_in_shard")


def yielded(prefix: Path, num_ranks: int) -> list[dict]:
    """The hook's records of one launch, every rank's; a torn last line (killed mid-write) is dropped."""
    records = []
    for rank in range(num_ranks):
        for line in Path(f"{prefix}-rank{rank}.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def expected_rows(records: list[dict], first_step: int, first_sample: int, global_batch: int,
                  row_names: list[tuple[str, int]]) -> set[tuple]:
    """(step, micro_step, rank, batch_row, sample, shard_path, row_in_shard) of every yielded row."""
    out = set()
    for record in records:
        per_rank, size = len(record["rows"]), record["micro_batch_size"]
        step = first_step + (record["sample"] - record["rank"] * per_rank - first_sample) // global_batch
        for index, row in enumerate(record["rows"]):
            out.add((step, index // size, record["rank"], index % size, record["sample"] + index, *row_names[row]))
    return out


def train_row_names(run_dir: Path) -> list[tuple[str, int]]:
    """(shard_path, row_in_shard) of each global train row number: the index's train shards, in order."""
    return [(info.path, row) for info in read_shard_index(run_dir) if info.split == "train"
            for row in range(info.num_rows)]


@pytest.mark.slow
def test_consumed_is_what_the_loader_yielded_across_kill_and_two_to_one_processes(
        make_run_dir: MakeRunDir, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = make_run_dir(train={**SETTINGS, "num_processes": 2})
    hook = tmp_path / "yielded"
    with open(tmp_path / "launch0.log", "wb") as log:
        process = subprocess.Popen(launch_command(run_dir, 2), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, YIELDED_ROWS_HOOK: f"{hook}-0"}, start_new_session=True)
    wait_for_step(run_dir, 6, process)  # past the step-4 checkpoint (a busy machine may see a later step)
    ranks = psutil.Process(process.pid).children(recursive=True)
    for victim in [psutil.Process(process.pid), *ranks]:  # kill -9 of the launcher and its ranks, as a crash does
        with contextlib.suppress(psutil.Error):
            victim.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert psutil.wait_procs(ranks, timeout=60)[1] == []  # gone, so the resume can take the run-dir lock

    edit_recipe(run_dir, "train", num_processes=1)
    monkeypatch.setenv(YIELDED_ROWS_HOOK, f"{hook}-1")
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 0
    resumed = int(capsys.readouterr().out.split("Resuming from checkpoint at step ")[1].split()[0])
    assert resumed % 4 == 0 and 4 <= resumed < MAX_STEPS

    names = train_row_names(run_dir)
    first = yielded(Path(f"{hook}-0"), 2)
    assert max(record["sample"] for record in first) >= resumed * 8, "the killed launch ran past its checkpoint"
    expected = expected_rows([r for r in first if r["sample"] < resumed * 8], 1, 0, 8, names)
    expected |= expected_rows(yielded(Path(f"{hook}-1"), 1), resumed + 1, resumed * 8, 4, names)
    consumed = run_query(run_dir, f"SELECT {', '.join(COLUMNS)}, segment FROM consumed ORDER BY sample").to_pylist()
    assert {tuple(row[name] for name in COLUMNS) for row in consumed} == expected
    assert len(consumed) == len(expected) == resumed * 8 + (MAX_STEPS - resumed) * 4  # no sample twice
    assert {row["segment"] for row in consumed} == {0, 1}
    launches = run_query(run_dir, "SELECT segment, start_step, start_sample, num_processes, world_size "
                                  "FROM train_segments ORDER BY segment").to_pylist()
    assert [tuple(row.values()) for row in launches] == [(0, 0, 0, 2, 2), (1, resumed, resumed * 8, 1, 1)]

    # row_losses: the same rows (the killed launch's replaced steps left out), and they average to the step's loss.
    losses = run_query(run_dir, "SELECT l.step, l.sample, l.loss, c.rank FROM row_losses l "
                                "JOIN consumed c USING (step, micro_step, rank, batch_row, sample)").to_pylist()
    assert sorted(row["sample"] for row in losses) == [row["sample"] for row in consumed]
    step_loss = {row["step"]: row["loss"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")}
    for step in range(1, MAX_STEPS + 1):
        mean = np.mean([row["loss"] for row in losses if row["step"] == step])
        assert mean == pytest.approx(step_loss[step], rel=1e-3), step

    # A torn row-loss line is skipped; a damaged launch record is one error naming the file.
    with next((run_dir / "metrics" / "row_losses").iterdir()).open("a") as torn:
        torn.write('{"step": 9, "sam')
    assert run_query(run_dir, "SELECT count(*) AS n FROM row_losses").column("n")[0].as_py() == len(consumed)
    segments = run_dir / "metrics" / "train_segments.jsonl"
    segments.write_text(segments.read_text().replace('"world_size": 2', '"world_size": "two"'))
    with pytest.raises(QueryError, match=r"train_segments\.jsonl: launch 0 cannot be replayed"):
        run_query(run_dir, "SELECT count(*) FROM consumed")
    assert run_query(run_dir, "SELECT count(*) AS n FROM train_metrics").column("n")[0].as_py() == MAX_STEPS


def test_row_losses_leave_training_bitwise_unchanged(make_run_dir: MakeRunDir) -> None:
    settings = {"max_steps": 2, "eval_every": 100, "eval_batches": 1, "checkpoint_every": 2}
    runs = {flag: make_run_dir(f"row-losses-{flag}", train={**settings, "log_row_losses": flag})
            for flag in (False, True)}
    for run_dir in runs.values():
        assert main(["--run-dir", str(run_dir)]) == 0
    off, on = (exported_weights(runs[flag]) for flag in (False, True))
    assert all(torch.equal(off[name], on[name]) for name in off)
    assert ([row["loss"] for row in read_metric_rows(runs[False] / "metrics" / "train.jsonl")]
            == [row["loss"] for row in read_metric_rows(runs[True] / "metrics" / "train.jsonl")])
    assert not (runs[False] / "metrics" / "row_losses").exists()
    count = run_query(runs[True], "SELECT count(*) AS n, count(loss) AS finite FROM row_losses").to_pylist()
    assert count == [{"n": 2 * 4, "finite": 2 * 4}]
