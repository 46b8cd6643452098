"""Property tests of tokenization/pack.py: packing loses, duplicates and misplaces no token, and lineage is exact."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import ConfigError
from core.shards.store import ShardRows
from tokenization.pack import Packer

EOS, PAD = 0, 1


def random_docs(rng: np.random.Generator, num_docs: int, seq_len: int) -> list[np.ndarray]:
    """Documents of mixed lengths: empty, shorter than a row, several rows long; ids never EOS or PAD."""
    kinds = rng.integers(0, 4, size=num_docs)
    lengths = np.select(
        [kinds == 0, kinds == 1, kinds == 2],
        [np.zeros(num_docs, dtype=np.int64), rng.integers(1, seq_len, size=num_docs),
         rng.integers(seq_len - 2, seq_len + 2, size=num_docs)],
        rng.integers(seq_len, 5 * seq_len, size=num_docs),
    )
    return [rng.integers(2, 60_000, size=int(n)).astype(np.uint32) for n in lengths]


def pack_randomly(docs: list[np.ndarray], seq_len: int, rng: np.random.Generator) -> list[ShardRows]:
    """Add documents while taking rows at random moments and sizes, then drain and finish."""
    packer = Packer(seq_len, EOS, PAD, np.dtype(np.uint16))
    out = []
    for doc_id, tokens in enumerate(docs):
        packer.add(1000 + doc_id, tokens)
        if rng.random() < 0.3 and (rows := packer.take_rows(int(rng.integers(1, 5)))) is not None:
            out.append(rows)
    while (rows := packer.take_rows(3)) is not None:
        out.append(rows)
    if (rows := packer.finish()) is not None:
        out.append(rows)
    assert packer.finish() is None
    return out


def expected_stream(docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.append(doc, EOS) for doc in docs]).astype(np.uint16)


def expected_lineage(docs: list[np.ndarray], seq_len: int) -> list[tuple[list[int], list[int], int, int]]:
    """Per-row (doc_ids, doc_starts, first_doc_offset, num_tokens) computed token by token (slow, obvious)."""
    owner = np.concatenate([np.full(doc.size + 1, 1000 + i) for i, doc in enumerate(docs)])
    position_in_doc = np.concatenate([np.arange(doc.size + 1) for doc in docs])
    rows = []
    for start in range(0, owner.size, seq_len):
        row_owner, row_pos = owner[start:start + seq_len], position_in_doc[start:start + seq_len]
        doc_ids, doc_starts = [], []
        for i, doc_id in enumerate(row_owner.tolist()):
            if not doc_ids or doc_ids[-1] != doc_id:
                doc_ids.append(doc_id)
                doc_starts.append(i)
        rows.append((doc_ids, doc_starts, int(row_pos[0]), int(row_owner.size)))
    return rows


def concat_rows(chunks: list[ShardRows]) -> ShardRows:
    return ShardRows(
        input_ids=np.concatenate([chunk.input_ids for chunk in chunks]),
        doc_ids=[ids for chunk in chunks for ids in chunk.doc_ids],
        doc_starts=[starts for chunk in chunks for starts in chunk.doc_starts],
        first_doc_offset=[offset for chunk in chunks for offset in chunk.first_doc_offset],
        num_tokens=[count for chunk in chunks for count in chunk.num_tokens],
    )


CASES = [(seed, seq_len) for seed in range(8) for seq_len in (8, 13, 64)]


@pytest.mark.parametrize(("seed", "seq_len"), CASES)
def test_rows_minus_padding_reproduce_the_token_stream(seed: int, seq_len: int) -> None:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 60, seq_len)
    rows = concat_rows(pack_randomly(docs, seq_len, rng))
    stream = expected_stream(docs)
    real = np.concatenate([row[:count] for row, count in zip(rows.input_ids, rows.num_tokens, strict=True)])
    assert rows.input_ids.shape[1] == seq_len
    assert rows.input_ids.dtype == np.uint16
    np.testing.assert_array_equal(real, stream)
    assert all(count == seq_len for count in rows.num_tokens[:-1])
    assert (rows.input_ids[-1, rows.num_tokens[-1]:] == PAD).all()


@pytest.mark.parametrize(("seed", "seq_len"), CASES)
def test_lineage_matches_a_token_by_token_reference(seed: int, seq_len: int) -> None:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 60, seq_len)
    rows = concat_rows(pack_randomly(docs, seq_len, rng))
    got = list(zip(rows.doc_ids, rows.doc_starts, rows.first_doc_offset, rows.num_tokens, strict=True))
    want = [(ids, starts, offset, count) for ids, starts, offset, count in expected_lineage(docs, seq_len)]
    assert got == want


@pytest.mark.parametrize(("seed", "seq_len"), CASES)
def test_each_document_starts_once_and_reads_back_to_its_eos(seed: int, seq_len: int) -> None:
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, 60, seq_len)
    rows = concat_rows(pack_randomly(docs, seq_len, rng))
    flat = rows.input_ids.reshape(-1)
    found: dict[int, np.ndarray] = {}
    for row, (ids, starts, offset) in enumerate(zip(rows.doc_ids, rows.doc_starts, rows.first_doc_offset,
                                                    strict=True)):
        for k, (doc_id, start) in enumerate(zip(ids, starts, strict=True)):
            if k == 0 and offset > 0:
                continue  # continued from the previous row: it started there
            begin = row * seq_len + start
            end = begin + int(np.flatnonzero(flat[begin:] == EOS)[0])
            assert doc_id not in found, f"document {doc_id} starts twice"
            found[doc_id] = flat[begin:end]
    assert sorted(found) == [1000 + i for i in range(len(docs))]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(found[1000 + i], doc)


def test_take_rows_returns_only_full_rows_and_finish_pads() -> None:
    packer = Packer(8, EOS, PAD, np.dtype(np.uint16))
    packer.add(7, np.arange(2, 12))  # 10 tokens + EOS = 11
    assert packer.num_full_rows == 1
    first = packer.take_rows(5)
    assert first is not None and len(first) == 1
    assert packer.take_rows(5) is None
    last = packer.finish()
    assert last is not None
    assert last.input_ids.tolist() == [[10, 11, EOS, PAD, PAD, PAD, PAD, PAD]]
    assert (last.doc_ids, last.doc_starts, last.first_doc_offset, last.num_tokens) == ([[7]], [[0]], [8], [3])


def test_ids_that_do_not_fit_the_row_dtype_are_refused() -> None:
    packer = Packer(8, EOS, PAD, np.dtype(np.uint16))
    with pytest.raises(ConfigError, match="does not fit uint16"):
        packer.add(1, np.array([5, 70_000], dtype=np.uint32))


def test_a_very_long_document_packs_exactly() -> None:
    # 20 M tokens taken 4 rows at a time: re-copying the pending tail per take would move ~400 GB,
    # so a quadratic packer never finishes this test (speed itself is measured in benchmarks/).
    tokens = np.random.default_rng(0).integers(2, 60_000, size=20_000_000).astype(np.uint32)
    packer = Packer(256, EOS, PAD, np.dtype(np.uint16))
    packer.add(1, tokens)
    num_rows = 0
    while (rows := packer.take_rows(4)) is not None:
        num_rows += len(rows)
        assert rows.doc_ids[-1] == [1]
    last = packer.finish()
    assert last is not None
    assert num_rows * 256 + last.num_tokens[0] == tokens.size + 1
    assert last.first_doc_offset[0] == num_rows * 256
