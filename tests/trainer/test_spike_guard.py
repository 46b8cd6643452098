"""trainer/spike_guard.py and the loop's use of it: loss spikes from corrupted shard rows are skipped, a streak of
them rolls back to the newest checkpoint past the batches since, and the run says (and train_metrics records) so.

The spikes are real: the rows the loader serves at chosen steps are overwritten in the shards (and the index
re-hashed) with one rare token repeated, as a corrupted or degenerate document would be, so those steps' losses
jump while every other step trains on the standard library as usual.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from core.shards.store import ShardRows, read_shard_index, write_shard, write_shard_index
from flows.run_sql import run_query
from tests.trainer.conftest import VOCAB_SIZE, MakeRunDir, exported_weights
from trainer.loader.batches import PAD_ID, BatchLayout, SplitRows, TrainLoader
from trainer.loop import LoopCounters
from trainer.metrics.sink import read_metric_rows
from trainer.spike_guard import SpikeGuard
from trainer.train import main

GARBAGE_TOKEN = VOCAB_SIZE - 1
"""The rarest BPE merge of the test tokenizer, repeated over a whole row: a corrupted document."""


def corrupt_steps(run_dir: Path, steps: list[int], micro_batch_size: int, seed: int = 0) -> None:
    """Overwrite, in the shards themselves, every row the loader serves at ``steps`` (1-based, one process,
    no accumulation) with GARBAGE_TOKEN; the index is rewritten with the new hashes."""
    rows = SplitRows(run_dir, "train", PAD_ID)
    loader = TrainLoader(rows, BatchLayout(micro_batch_size, 1), seed)
    wanted = np.concatenate([loader.global_rows((step - 1) * micro_batch_size, micro_batch_size) for step in steps])
    infos = {info.path: info for info in read_shard_index(run_dir)}
    train_paths = [info.path for info in infos.values() if info.split == "train"]
    for number, path in enumerate(train_paths):
        local = wanted[(wanted >= rows.starts[number]) & (wanted < rows.starts[number + 1])] - rows.starts[number]
        if len(local):
            infos[path] = rewrite_rows(run_dir, infos[path], local)
    rows.close()
    write_shard_index(run_dir, list(infos.values()))


def rewrite_rows(run_dir: Path, info: object, local_rows: np.ndarray) -> object:
    with pa.memory_map(str(run_dir / info.path)) as source:
        table = ipc.open_file(source).read_all()
        metadata = {key.decode(): value.decode() for key, value in table.schema.metadata.items()}
        tokens = np.array(table.column("input_ids").combine_chunks().flatten().to_numpy()).reshape(-1, info.seq_len)
        lineage = [table.column(name).to_pylist() for name in ("doc_ids", "doc_starts", "first_doc_offset",
                                                                "num_tokens")]
    tokens[local_rows] = GARBAGE_TOKEN
    return write_shard(run_dir, info.path, ShardRows(tokens, *lineage), split=info.split, source=info.source,
                       tokenizer_sha256=metadata["tokenizer_sha256"], vocab_size=int(metadata["vocab_size"]))


def guard(zscore: float | None = 3.0, window: int = 4, max_in_a_row: int = 2) -> SpikeGuard:
    return SpikeGuard(zscore, window, max_in_a_row, LoopCounters())


def test_a_loss_far_above_the_recent_ones_is_a_spike_once_the_window_is_full() -> None:
    spikes = guard()
    for loss in (1.0, 1.1, 0.9):
        assert not spikes.is_spike(50.0)  # fewer than spike_window losses known: nothing is judged
        spikes.record(loss, spike=False, applied=True)
    spikes.record(1.0, spike=False, applied=True)
    # mean 1.0, std sqrt(0.005) = 0.0707: 1.2 is 2.83 standard deviations above, 1.25 is 3.54
    assert math.isclose(spikes.z_score(1.2), 0.2 / math.sqrt(0.005)) and not spikes.is_spike(1.2)
    assert spikes.is_spike(1.25) and not spikes.is_spike(0.5) and not spikes.is_spike(math.nan)
    spikes.record(1.25, spike=True, applied=False)
    assert (spikes.counters.spike_steps, spikes.counters.spikes_in_a_row) == (1, 1) and spikes.in_streak
    assert spikes.counters.recent_losses == [1.0, 1.1, 0.9, 1.0]  # a spike never joins the window
    spikes.record(1.25, spike=True, applied=False)
    assert spikes.should_roll_back
    spikes.rolled_back()
    assert (spikes.counters.spikes_in_a_row, spikes.counters.rollbacks, spikes.counters.spike_steps) == (0, 1, 2)
    spikes.record(0.8, spike=False, applied=True)
    assert spikes.counters.recent_losses == [1.1, 0.9, 1.0, 0.8]  # the oldest leaves


def test_an_unapplied_step_does_not_join_the_window_and_off_judges_nothing() -> None:
    spikes = guard()
    spikes.record(1.0, spike=False, applied=False)  # e.g. an fp16 overflow: not a loss the weights produced
    assert spikes.counters.recent_losses == []
    off = guard(zscore=None)
    for _ in range(10):
        off.record(1.0, spike=False, applied=True)
    assert not off.is_spike(1e9) and off.counters.recent_losses == []


def test_guard_state_is_checkpointed_and_old_checkpoints_load() -> None:
    counters = LoopCounters(step=7, spike_steps=2, spikes_in_a_row=1, rollbacks=1, recent_losses=[1.5, 0.25])
    restored = LoopCounters()
    restored.load_state_dict(counters.state_dict())
    assert restored == counters
    old = LoopCounters()
    old.load_state_dict({"step": 3, "tokens_seen": 12, "skipped_steps": 1, "nonfinite_in_a_row": 0})
    assert (old.spike_steps, old.spikes_in_a_row, old.rollbacks, old.recent_losses) == (0, 0, 0, [])


SETTINGS = {"max_steps": 30, "checkpoint_every": 5, "eval_every": 100, "log_every": 1, "spike_zscore": 3.0,
            "spike_window": 8, "max_spikes_in_a_row": 3}
CORRUPTED_STEPS = [20, 25, 26, 27]
"""One lone spike (skipped), then three in a row (skipped, then a rollback to the checkpoint of step 15)."""


def spiky_run(make_run_dir: MakeRunDir, name: str) -> Path:
    run_dir = make_run_dir(name, train=SETTINGS)
    corrupt_steps(run_dir, CORRUPTED_STEPS, micro_batch_size=4)
    return run_dir


def test_spikes_are_skipped_a_streak_rolls_back_and_the_run_says_what_it_skipped(
        make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture) -> None:
    run_dir = spiky_run(make_run_dir, "spiky")
    assert main(["--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "step 20: loss " in out and " is a spike (" in out
    assert "checkpoint at step 25 skipped: 1 loss spike(s) in a row" in out
    # Rolled back to step 15's checkpoint; samples 60-107 (steps 16-27, 4 per step) are never trained on.
    assert "step 27: 3 loss spikes in a row (since step 25); rolled back to step 15, samples 60-107 skipped" in out
    assert "skipped 4 loss-spike step(s), 1 rollback(s)" in out
    spikes = run_query(run_dir, "SELECT step, rolled_back_to_step, samples_skipped_from, samples_skipped_to "
                                "FROM train_metrics WHERE spike_z_score IS NOT NULL ORDER BY step").to_pylist()
    assert [row["step"] for row in spikes] == CORRUPTED_STEPS  # every corrupted step, and nothing else
    assert spikes[-1] == {"step": 27, "rolled_back_to_step": 15, "samples_skipped_from": 60, "samples_skipped_to": 108}
    rows = {row["step"]: row for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")}
    assert (rows[30]["skipped_steps"], rows[30]["spike_steps"]) == (4, 4)
    # The rollback restored step 15's optimizer and LR schedule: step 28 runs at step 16's learning rate.
    assert rows[28]["lr"] == rows[16]["lr"] and rows[28]["lr"] != rows[27]["lr"]
    # consumed names the rows each step trained on: the corrupted ones exactly at the corrupted steps; it flags
    # the spikes, and the rollback's undone steps 16-27.
    garbage = run_query(run_dir, "SELECT DISTINCT c.step FROM consumed c JOIN sequences s USING (shard_path, "
                                 "row_in_shard) WHERE list_unique(s.input_ids) = 1 "
                                 f"AND s.input_ids[1] = {GARBAGE_TOKEN} ORDER BY c.step")
    assert garbage.column("step").to_pylist() == CORRUPTED_STEPS
    flags = run_query(run_dir, "SELECT step, bool_or(spike) AS spike, bool_or(rolled_back) AS rolled_back "
                               "FROM consumed GROUP BY step ORDER BY step").to_pylist()
    assert [row["step"] for row in flags] == list(range(1, 31))
    assert [row["step"] for row in flags if row["spike"]] == CORRUPTED_STEPS
    assert [row["step"] for row in flags if row["rolled_back"]] == list(range(16, 28))


def test_a_run_killed_after_a_rollback_resumes_bitwise(make_run_dir: MakeRunDir,
                                                       capsys: pytest.CaptureFixture) -> None:
    straight, resumed = spiky_run(make_run_dir, "straight"), spiky_run(make_run_dir, "resumed")
    assert main(["--run-dir", str(straight)]) == 0
    assert main(["--run-dir", str(resumed), "--until-step", "28"]) == 0  # rolled back at 27, checkpoint at 28
    shutil.rmtree(resumed / "checkpoints" / "step-0000028")  # killed before its next checkpoint: resume at 15
    capsys.readouterr()
    assert main(["--run-dir", str(resumed)]) == 0
    out = capsys.readouterr().out
    assert "Resuming from checkpoint at step 15" in out and "rolled back to step 15" in out
    straight_weights, resumed_weights = exported_weights(straight), exported_weights(resumed)
    assert all(torch.equal(straight_weights[name], resumed_weights[name]) for name in straight_weights)
    losses = [[row["loss"] for row in read_metric_rows(run / "metrics" / "train.jsonl")] for run in (straight, resumed)]
    assert losses[0] == losses[1]
    # The same history, though the resumed run took two launches and trained steps 16-28 twice.
    sql = "SELECT * EXCLUDE (segment) FROM consumed ORDER BY sample"
    assert run_query(resumed, sql) == run_query(straight, sql)
    assert run_query(resumed, "SELECT max(segment) AS n FROM consumed").column("n").to_pylist() == [1]


def test_bad_spike_settings_are_one_line_naming_the_key(make_run_dir: MakeRunDir,
                                                        capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir("bad", train={"spike_zscore": -1})
    assert main(["--run-dir", str(run_dir)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "train.spike_zscore" in error[0]
