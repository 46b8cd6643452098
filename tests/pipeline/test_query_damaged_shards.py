"""A run with a damaged shard: only statements that read ``sequences`` fail, naming the file; every shard reader
(the view, ``shards stats``/``sample``, the loader, the ``datasets`` bridge) refuses bytes the index does not vouch
for."""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from core.errors import QueryError, ShardFormatError
from core.files import digests as file_digests
from core.files.atomic import sha256_file
from core.files.digests import forget_digests
from core.shards.dataset import shards_as_dataset
from core.shards.store import ShardRows, read_shard_index, write_shard, write_shard_index
from flows.run_sql import connect, run_query
from pipeline.shard_stats import shard_stats
from pipeline.sql.query import data_funnel, token_mix
from tests.conftest import build_query_run
from tokenization.sample import sample_rows
from trainer.loader.batches import SplitRows

SHARD = "shards/split=train/source=a/part-00000.arrow"
TOKENMILL = str(Path(sys.executable).parent / "tokenmill")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return build_query_run(tmp_path / "run")


def truncate(shard: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:500])


def point_list_offsets_past_their_values(shard: Path) -> None:
    """Rewrite the list offsets of the two rows (0, 1, 3: doc_ids and doc_starts alike) to end at 2**30:
    the file still opens, and only a full validation sees that the lists reach past their values."""
    data = shard.read_bytes()
    offsets = struct.pack("<3i", 0, 1, 3)
    assert data.count(offsets) == 2
    shard.write_bytes(data.replace(offsets, struct.pack("<3i", 0, 1, 1 << 30)))


@pytest.mark.parametrize("damage", [truncate, point_list_offsets_past_their_values])
def test_a_damaged_shard_fails_only_what_reads_sequences(run_dir: Path, damage) -> None:
    damage(run_dir / SHARD)
    assert run_query(run_dir, "SELECT count(*) AS n FROM documents").to_pylist() == [{"n": 2}]
    assert run_query(run_dir, "SELECT sum(num_rows) AS n FROM shards").to_pylist() == [{"n": 2}]
    assert data_funnel(run_dir) and token_mix(run_dir)  # the named questions read no shard file
    with pytest.raises(QueryError) as refused:
        run_query(run_dir, "SELECT count(*) FROM Sequences")
    message = str(refused.value)
    assert message.startswith(f"{run_dir / SHARD}: not a readable Arrow IPC shard") and "\n" not in message
    assert f"`tokenmill shards verify {run_dir}`" in message


def test_a_connection_for_a_statement_without_sequences_opens_no_shard(run_dir: Path) -> None:
    truncate(run_dir / SHARD)
    con = connect(run_dir, "SELECT count(*) FROM rejects")
    assert con.sql("SELECT count(*) FROM sequences").fetchall() == [(0,)]  # listed, empty: nothing was opened
    with pytest.raises(QueryError, match="not a readable Arrow IPC shard"):
        connect(run_dir)  # a notebook's connection is for any statement: it opens every shard


# ---- every reader checks a shard's bytes against the index (issue #34, class 5) -------------------

TOKENS = np.arange(16, dtype=np.uint16).tobytes()
"""The token data of build_query_run's shard: two rows of 8 ids, 0..15, little-endian uint16."""


@pytest.fixture(autouse=True)
def own_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A digest cache of this test's own, and nothing remembered from another test of this process."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    forget_digests()
    yield cache
    forget_digests()


def flip_a_token_byte(shard: Path) -> None:
    """Token 5's high byte XOR 0xff: id 5 becomes 65285, the file still parses and validates."""
    data = bytearray(shard.read_bytes())
    data[data.index(TOKENS) + 2 * 5 + 1] ^= 0xFF
    shard.write_bytes(bytes(data))


def flip_a_metadata_byte(shard: Path) -> None:
    """One character of the tokenizer sha256 in the schema metadata (``t`` * 64 -> ``u`` + ``t`` * 63)."""
    data = shard.read_bytes()
    shard.write_bytes(data.replace(b"t" * 64, b"u" + b"t" * 63, 1))


def swap_for_another_valid_shard(shard: Path) -> None:
    """Another shard written by tokenmill, same shape and size, other token ids (a shard of another run)."""
    other = shard.parent.parent.parent.parent.parent / "other-run"
    rows = ShardRows(np.arange(16, dtype=np.uint16).reshape(2, 8)[::-1].copy(), [[1], [1, 3]], [[0], [0, 3]],
                     [0, 8], [8, 8])
    info = write_shard(other, SHARD, rows, split="train", source="a", tokenizer_sha256="t" * 64, vocab_size=100)
    assert (other / info.path).stat().st_size == shard.stat().st_size
    shard.write_bytes((other / info.path).read_bytes())


def alter_the_index_row(shard: Path) -> None:
    """The index's sha256 of the shard changed (the shard itself untouched)."""
    run_dir = shard.parents[3]
    write_shard_index(run_dir, [dataclasses.replace(info, sha256="0" * 64) for info in read_shard_index(run_dir)])


def damaged_line(run_dir: Path) -> str:
    return f"{run_dir / SHARD}: its sha256 differs from shards/index.parquet"


@pytest.mark.parametrize("damage", [flip_a_token_byte, flip_a_metadata_byte, swap_for_another_valid_shard,
                                    alter_the_index_row])
def test_sequences_refuses_a_shard_whose_bytes_differ_from_the_index(run_dir: Path, damage) -> None:
    damage(run_dir / SHARD)
    assert run_query(run_dir, "SELECT count(*) AS n FROM documents").to_pylist() == [{"n": 2}]
    with pytest.raises(QueryError) as refused:
        run_query(run_dir, "SELECT max(list_max(input_ids)) FROM sequences")
    message = str(refused.value)
    assert message.startswith(damaged_line(run_dir)) and "\n" not in message
    assert f"`tokenmill shards verify {run_dir}`" in message


READERS = {
    "shards stats": lambda run_dir: shard_stats(run_dir),
    "shards sample": lambda run_dir: sample_rows(run_dir, 2, decode=False),
    "loader": lambda run_dir: SplitRows(run_dir, "train", pad_id=1),
    "datasets": lambda run_dir: shards_as_dataset(run_dir),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("damage", [flip_a_token_byte, swap_for_another_valid_shard])
def test_every_reader_refuses_a_shard_whose_bytes_differ_from_the_index(run_dir: Path, reader: str, damage) -> None:
    damage(run_dir / SHARD)
    with pytest.raises(ShardFormatError) as refused:
        READERS[reader](run_dir)
    message = str(refused.value)
    assert message.startswith(damaged_line(run_dir)) and "\n" not in message
    assert f"`tokenmill shards verify {run_dir}`" in message


def test_a_shard_the_index_does_not_list_or_a_listed_one_missing_is_refused(run_dir: Path) -> None:
    extra = "shards/split=train/source=b/part-00000.arrow"
    rows = ShardRows(np.full((1, 8), 7, dtype=np.uint16), [[3]], [[0]], [0], [8])
    write_shard(run_dir, extra, rows, split="train", source="b", tokenizer_sha256="t" * 64, vocab_size=100)
    with pytest.raises(QueryError, match=r"shards/index\.parquet does not list") as refused:
        run_query(run_dir, "SELECT count(*) FROM sequences")
    assert str(run_dir / extra) in str(refused.value)
    (run_dir / extra).unlink()
    (run_dir / SHARD).unlink()
    with pytest.raises(QueryError, match=r"missing, listed in shards/index\.parquet") as refused:
        run_query(run_dir, "SELECT count(*) FROM sequences")
    assert str(run_dir / SHARD) in str(refused.value)
    with pytest.raises(ShardFormatError, match=r"missing, listed in shards/index\.parquet"):
        shard_stats(run_dir)


def test_a_shard_is_hashed_once_per_version_and_a_flip_behind_a_restored_mtime_is_seen(
        run_dir: Path, own_digest_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []

    def counting_sha256(path: Path) -> str:  # a spy: the real hash, counted
        hashed.append(Path(path).name)
        return sha256_file(path)

    monkeypatch.setattr(file_digests, "sha256_mapped", counting_sha256)
    forget_digests()  # as a process on a machine that did not write the shard (the writer remembers its hash)
    shutil.rmtree(own_digest_cache)
    rows = SplitRows(run_dir, "train", pad_id=1)
    for _ in range(20):  # the loader's hot path hashes nothing
        assert rows.rows(np.array([1, 0])).tolist() == [list(range(8, 16)), list(range(8))]
    shard_stats(run_dir)
    run_query(run_dir, "SELECT count(*) FROM sequences")
    assert hashed == ["part-00000.arrow"], "once for the whole process"

    forget_digests()  # as a new process: the cache file outside the run dir answers
    SplitRows(run_dir, "train", pad_id=1)
    assert hashed == ["part-00000.arrow"]
    assert len(list((own_digest_cache / "tokenmill" / "shard-digests").iterdir())) == 1

    shard = run_dir / SHARD
    before = shard.stat()
    flip_a_token_byte(shard)
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: the ctime still moves
    with pytest.raises(ShardFormatError, match="its sha256 differs"):
        SplitRows(run_dir, "train", pad_id=1)


def test_the_cli_readers_refuse_a_flipped_token_byte_in_one_line(run_dir: Path) -> None:
    flip_a_token_byte(run_dir / SHARD)
    for args in (["query", run_dir, "SELECT max(list_max(input_ids)) FROM sequences"],
                 ["shards", "stats", run_dir], ["shards", "sample", run_dir, "--n", "2"]):
        result = subprocess.run([TOKENMILL, *map(str, args)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: {damaged_line(run_dir)}") and "shards verify" in line
        assert "65285" not in result.stdout
