"""trainer/loader/batches.py: deterministic global order, disjoint ranks, O(1) JSON state, world-size change on
resume."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import CheckpointError, ShardFormatError
from core.shards.store import ShardTokens, read_shard_index
from tests.trainer.conftest import SEQ_LEN, Corpus, write_corpus_shards
from trainer.loader.batches import PAD_ID, ArrayRows, Batch, BatchLayout, SplitRows, TrainLoader, make_batch
from trainer.model.llama import IGNORE_INDEX


@pytest.fixture
def run_dir(tmp_path: Path, stdlib_corpus: Corpus) -> Path:
    write_corpus_shards(tmp_path, stdlib_corpus, SEQ_LEN)
    return tmp_path


@pytest.fixture
def train_rows(run_dir: Path) -> SplitRows:
    return SplitRows(run_dir, "train", PAD_ID)


def loader(rows: SplitRows, micro: int = 4, accum: int = 1, world: int = 1, rank: int = 0,
           seed: int = 0) -> TrainLoader:
    return TrainLoader(rows, BatchLayout(micro, accum, world, rank), seed)


def step_ids(batches: list[Batch]) -> torch.Tensor:
    return torch.cat([batch.input_ids for batch in batches])


def test_split_rows_number_every_train_shard_in_index_order(run_dir: Path, train_rows: SplitRows) -> None:
    infos = [info for info in read_shard_index(run_dir) if info.split == "train"]
    assert len(infos) >= 3  # several shards and two sources, so the numbering crosses shard boundaries
    expected = np.concatenate([ShardTokens(run_dir / info.path).tokens for info in infos])
    assert train_rows.num_rows == len(expected) == sum(info.num_rows for info in infos)
    picks = np.array([0, infos[0].num_rows - 1, infos[0].num_rows, len(expected) - 1])
    assert np.array_equal(train_rows.rows(picks), expected[picks])
    assert (train_rows.seq_len, train_rows.vocab_size) == (SEQ_LEN, 512)


def test_order_is_deterministic_and_each_epoch_is_a_permutation(train_rows: SplitRows) -> None:
    first, again, other_seed = loader(train_rows), loader(train_rows), loader(train_rows, seed=1)
    for _ in range(3):
        batch = step_ids(first.next_step())
        assert torch.equal(batch, step_ids(again.next_step()))
        assert not torch.equal(batch, step_ids(other_seed.next_step()))
    n = train_rows.num_rows
    epoch0, epoch1 = first.global_rows(0, n), first.global_rows(n, n)
    assert sorted(epoch0.tolist()) == list(range(n)) == sorted(epoch1.tolist())
    assert not np.array_equal(epoch0, epoch1)
    assert np.array_equal(first.global_rows(n - 2, 4), np.concatenate([epoch0[-2:], epoch1[:2]]))


def test_ranks_take_disjoint_slices_of_the_same_global_batch(train_rows: SplitRows) -> None:
    single = loader(train_rows, micro=4, accum=2, world=1)
    ranks = [loader(train_rows, micro=4, accum=1, world=2, rank=r) for r in (0, 1)]
    for _ in range(4):
        rank_batches = [step_ids(rank.next_step()) for rank in ranks]
        rows0, rows1 = ({tuple(row) for row in batch.tolist()} for batch in rank_batches)
        assert not rows0 & rows1
        assert torch.equal(torch.cat(rank_batches), step_ids(single.next_step()))


def test_state_is_json_and_world_2_state_resumes_on_world_1(train_rows: SplitRows) -> None:
    ranks = [loader(train_rows, micro=4, accum=1, world=2, rank=r) for r in (0, 1)]
    for _ in range(5):
        for rank in ranks:
            rank.next_step()
    state = json.loads(json.dumps(ranks[0].state_dict()))
    assert state["samples_consumed"] == 5 * 8 == ranks[1].state_dict()["samples_consumed"]
    resumed = loader(train_rows, micro=4, accum=2, world=1)  # grad accumulation doubled: same global batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same global batch: nothing to warn about
        resumed.load_state_dict(state)
    for _ in range(3):
        continued = torch.cat([step_ids(rank.next_step()) for rank in ranks])
        micro_batches = resumed.next_step()
        assert len(micro_batches) == 2
        assert torch.equal(step_ids(micro_batches), continued)


def test_resume_with_another_global_batch_warns_and_keeps_the_sample_order(train_rows: SplitRows) -> None:
    before = loader(train_rows, micro=4)
    before.next_step()
    after = loader(train_rows, micro=8)
    with pytest.warns(UserWarning, match="global batch changed from 4 to 8"):
        after.load_state_dict(before.state_dict())
    assert np.array_equal(after.global_rows(after.samples_consumed, 8), before.global_rows(4, 8))


def test_batches_are_int64_with_padding_masked(run_dir: Path, train_rows: SplitRows) -> None:
    infos = [info for info in read_shard_index(run_dir) if info.split == "train"]
    last_row_of_first_source = sum(info.num_rows for info in infos if info.source == infos[0].source) - 1
    batch = loader(train_rows).next_step()[0]
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.input_ids.shape == (4, SEQ_LEN)
    padded = make_batch(train_rows.rows(np.array([last_row_of_first_source])), PAD_ID)
    is_pad = padded.input_ids == PAD_ID
    assert is_pad.any()  # a source's last row is padded
    assert torch.equal(padded.labels == IGNORE_INDEX, is_pad)


def test_changed_shards_are_refused_unless_allowed(train_rows: SplitRows) -> None:
    state = loader(train_rows).state_dict()
    tampered = {**state, "shards": {**state["shards"], next(iter(state["shards"])): "0" * 64}}
    with pytest.raises(CheckpointError, match="--allow-data-change"):
        loader(train_rows).load_state_dict(tampered)
    allowed = TrainLoader(train_rows, BatchLayout(4, 1), 0, allow_data_change=True)
    with pytest.warns(UserWarning, match="train data changed"):
        allowed.load_state_dict(tampered)
    with pytest.raises(CheckpointError, match=r"train\.seed"):
        loader(train_rows, seed=5).load_state_dict(state)


def test_appended_shards_continue_with_a_warning(train_rows: SplitRows) -> None:
    state = loader(train_rows).state_dict()
    fewer = {**state, "shards": dict(list(state["shards"].items())[:-1]), "samples_consumed": 12}
    resumed = loader(train_rows)
    with pytest.warns(UserWarning, match="train data changed"):
        resumed.load_state_dict(fewer)
    assert resumed.samples_consumed == 12


def test_array_rows_and_empty_split(run_dir: Path) -> None:
    tokens = np.arange(40, dtype=np.int64).reshape(10, 4)
    batches = TrainLoader(ArrayRows(tokens), BatchLayout(5, 2), seed=0).next_step()
    assert sorted(step_ids(batches)[:, 0].tolist()) == list(range(0, 40, 4))
    with pytest.raises(ShardFormatError, match="no train rows"):
        TrainLoader(SplitRows(run_dir, "nonexistent", PAD_ID), BatchLayout(4, 1), seed=0)


def test_pad_is_eos_masks_only_the_trailing_padding_and_keeps_real_eos_labels() -> None:
    eos = 5
    tokens = np.array([[7, 8, eos, 9, eos, eos, eos, eos],  # a source's last row: real EOS at 4, then padding
                       [eos, eos, eos, eos, eos, eos, eos, eos],  # last row holding only a document's EOS
                       [7, eos, 9, 9, 9, 9, 9, eos],  # a full row ending in a real EOS
                       [eos, 7, 8, 9, eos, 7, 8, 9]])
    batch = make_batch(tokens, eos, pad_is_eos=True)
    masked = (batch.labels == IGNORE_INDEX).numpy()
    expected = np.zeros_like(masked)
    expected[0, 5:] = expected[1, 1:] = True
    assert np.array_equal(masked, expected)
    assert torch.equal(batch.labels[~batch.labels.eq(IGNORE_INDEX)], batch.input_ids[~torch.from_numpy(expected)])
    assert batch.num_tokens == 32 - 3 - 7
    assert np.array_equal((make_batch(tokens, eos).labels == IGNORE_INDEX).numpy(), tokens == eos)  # the old rule


def test_pad_is_eos_without_padding_keeps_the_no_copy_fast_path() -> None:
    tokens = np.array([[7, 5, 9, 5], [5, 7, 8, 5]])
    batch = make_batch(tokens, 5, pad_is_eos=True)
    assert batch.labels.data_ptr() == batch.input_ids.data_ptr()  # labels are input_ids: no copy
    assert batch.num_tokens == 8


def test_loader_passes_pad_is_eos_to_its_batches() -> None:
    tokens = np.array([[7, 8, 5, 5]] * 4)
    batches = TrainLoader(ArrayRows(tokens, pad_id=5, pad_is_eos=True), BatchLayout(2, 2), seed=0).next_step()
    assert [batch.num_tokens for batch in batches] == [6, 6]
