"""core/shards/dataset.py: the shards as a ``datasets.Dataset``, row for row, without copying the tokens."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest

from core.errors import ConfigError, ShardFormatError
from core.shards.dataset import shards_as_dataset
from core.shards.store import ShardRows, ShardTokens, read_shard_index, shard_relpath, write_shard, write_shard_index

SEQ_LEN = 512
VOCAB_SIZE = 50_000
ROWS_PER_SHARD = 1_000
LAYOUT = [("train", "a", 0), ("train", "a", 1), ("train", "b", 0), ("val", "a", 0)]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Four shards of 1,000 rows x 512 uint16 ids (1 MB of tokens each), written by the real shard writer."""
    infos = []
    for number, (split, source, part) in enumerate(LAYOUT):
        ids = np.random.default_rng(number).integers(2, VOCAB_SIZE, size=(ROWS_PER_SHARD, SEQ_LEN))
        first_doc = number * ROWS_PER_SHARD
        rows = ShardRows(ids, [[first_doc + row] for row in range(ROWS_PER_SHARD)], [[0]] * ROWS_PER_SHARD,
                         [0] * ROWS_PER_SHARD, [SEQ_LEN] * ROWS_PER_SHARD)
        infos.append(write_shard(tmp_path, shard_relpath(split, source, part), rows, split=split, source=source,
                                 tokenizer_sha256="t" * 64, vocab_size=VOCAB_SIZE))
    write_shard_index(tmp_path, infos)
    return tmp_path


def test_the_dataset_holds_every_row_of_the_split_in_index_order(run_dir: Path) -> None:
    train = shards_as_dataset(run_dir)
    expected = np.concatenate([ShardTokens(run_dir / info.path).tokens for info in read_shard_index(run_dir)
                               if info.split == "train"])
    assert isinstance(train, datasets.Dataset) and train.split == "train"
    assert train.column_names == ["input_ids", "doc_ids", "doc_starts", "first_doc_offset", "num_tokens"]
    assert np.array_equal(train.with_format("numpy")[:]["input_ids"], expected)
    assert train[ROWS_PER_SHARD]["doc_ids"] == [ROWS_PER_SHARD]  # the second shard's first row
    assert len(shards_as_dataset(run_dir, split="val")) == ROWS_PER_SHARD
    assert len(shards_as_dataset(run_dir, split="train", source="b")) == ROWS_PER_SHARD


def test_no_token_is_copied(run_dir: Path) -> None:
    """Neither Arrow's pool nor the Python heap grows by the tokens: the columns are the mapped files' pages
    (a concat into one chunk, or datasets hashing the table for its fingerprint, would each copy them)."""
    token_bytes = 3 * ROWS_PER_SHARD * SEQ_LEN * 2
    pool_before = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        train = shards_as_dataset(run_dir)
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert train.data.nbytes >= token_bytes
    assert pa.total_allocated_bytes() - pool_before < token_bytes // 100
    assert python_peak < token_bytes // 10, f"{python_peak} bytes allocated in Python for {token_bytes} token bytes"


def test_the_fingerprint_follows_the_shards_contents(run_dir: Path) -> None:
    first = shards_as_dataset(run_dir)._fingerprint
    assert shards_as_dataset(run_dir)._fingerprint == first
    assert shards_as_dataset(run_dir, split="val")._fingerprint != first
    infos = read_shard_index(run_dir)  # a train shard with other rows, its index row saying so (readers check it)
    rows = ShardRows(np.full((2, SEQ_LEN), 7), [[0], [1]], [[0], [0]], [0, 0], [SEQ_LEN, SEQ_LEN])
    rewritten = write_shard(run_dir, infos[0].path, rows, split=infos[0].split, source=infos[0].source,
                            tokenizer_sha256="t" * 64, vocab_size=VOCAB_SIZE)
    write_shard_index(run_dir, [rewritten, *infos[1:]])
    assert shards_as_dataset(run_dir)._fingerprint != first


def test_a_split_or_source_without_shards_is_one_clear_error(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"no shards with split='test', source=None; `tokenmill shards stats"):
        shards_as_dataset(run_dir, split="test")
    with pytest.raises(ConfigError, match=r"split='val', source='b'"):
        shards_as_dataset(run_dir, split="val", source="b")


def test_a_truncated_shard_is_named_with_the_command_that_lists_damage(run_dir: Path) -> None:
    shard = run_dir / shard_relpath("train", "b", 0)
    shard.write_bytes(shard.read_bytes()[:4096])
    with pytest.raises(ShardFormatError, match="not a readable Arrow IPC shard") as refused:
        shards_as_dataset(run_dir)
    assert str(shard) in str(refused.value) and "tokenmill shards verify" in str(refused.value)
    assert len(shards_as_dataset(run_dir, split="val")) == ROWS_PER_SHARD  # the other split still reads
