"""pipeline.query over a run with a damaged shard: only statements that read ``sequences`` fail, naming the file."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from core.errors import QueryError
from pipeline.query import connect, data_funnel, run_query, token_mix
from tests.conftest import build_query_run

SHARD = "shards/split=train/source=a/part-00000.arrow"


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
