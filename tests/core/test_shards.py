"""core/shards/store.py: the shard writer is atomic and deterministic; verify_shards finds every kind of fault."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from core.errors import ShardFormatError
from core.files.atomic import TEMP_PREFIX, remove_stale_temps, sha256_file
from core.shards.store import (
    ShardInfo,
    ShardRows,
    ShardTokens,
    read_shard_index,
    shard_metadata,
    shard_relpath,
    verify_shards,
    write_shard,
    write_shard_index,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 16
VOCAB_SIZE = 500
TOKENIZER_SHA = "a" * 64


def make_rows(num_rows: int, seed: int = 0) -> ShardRows:
    """``num_rows`` full rows of random ids in [2, VOCAB_SIZE), one document per row (lineage kept simple)."""
    ids = np.random.default_rng(seed).integers(2, VOCAB_SIZE, size=(num_rows, SEQ_LEN))
    return ShardRows(ids, [[100 + row] for row in range(num_rows)], [[0] for _ in range(num_rows)],
                     [0] * num_rows, [SEQ_LEN] * num_rows)


def write_run(run_dir: Path, rows_per_shard: tuple[int, ...] = (5, 3)) -> list[ShardInfo]:
    """One train shard per entry of ``rows_per_shard`` plus one val shard, and the index."""
    infos = [write_shard(run_dir, shard_relpath("train", "lib", part), make_rows(num_rows, seed=part),
                         split="train", source="lib", tokenizer_sha256=TOKENIZER_SHA, vocab_size=VOCAB_SIZE)
             for part, num_rows in enumerate(rows_per_shard)]
    infos.append(write_shard(run_dir, shard_relpath("val", "lib", 0), make_rows(2, seed=9), split="val",
                             source="lib", tokenizer_sha256=TOKENIZER_SHA, vocab_size=VOCAB_SIZE))
    write_shard_index(run_dir, infos)
    return infos


def temp_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob(TEMP_PREFIX + "*"))


def rewrite_with_index_sha(run_dir: Path, relpath: str, batch: pa.RecordBatch) -> None:
    """Replace one shard with ``batch`` (uncompressed IPC file) and record its new sha256 in the index."""
    with ipc.new_file(run_dir / relpath, batch.schema) as out:
        out.write_batch(batch)
    infos = [dataclasses.replace(info, sha256=sha256_file(run_dir / info.path)) if info.path == relpath else info
             for info in read_shard_index(run_dir)]
    write_shard_index(run_dir, infos)


def read_batch(path: Path) -> pa.RecordBatch:
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).get_batch(0)


def test_round_trip_is_zero_copy_with_the_documented_schema_and_metadata(tmp_path: Path) -> None:
    rows = make_rows(5)
    info = write_shard(tmp_path, shard_relpath("train", "lib", 0), rows, split="train", source="lib",
                       tokenizer_sha256=TOKENIZER_SHA, vocab_size=VOCAB_SIZE)
    assert (info.num_rows, info.num_tokens, info.seq_len) == (5, 5 * SEQ_LEN, SEQ_LEN)
    metadata = shard_metadata(tmp_path / info.path)
    assert metadata["dtype"] == "uint16" and metadata["vocab_size"] == str(VOCAB_SIZE)
    shard = ShardTokens(tmp_path / info.path)
    assert shard.tokens.dtype == np.uint16 and not shard.tokens.flags.writeable  # a view of the mapped file
    np.testing.assert_array_equal(shard.tokens, rows.input_ids)
    shard.close()
    batch = read_batch(tmp_path / info.path)
    assert batch.column("doc_ids").to_pylist() == rows.doc_ids
    assert batch.schema.field("input_ids").type == pa.list_(pa.field("item", pa.uint16(), nullable=False), SEQ_LEN)


def test_writes_leave_no_temp_file_and_a_failed_write_keeps_the_old_shard(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    relpath = shard_relpath("train", "lib", 0)
    write_shard(tmp_path, relpath, make_rows(4), split="train", source="lib", tokenizer_sha256=TOKENIZER_SHA,
                vocab_size=VOCAB_SIZE)
    write_shard_index(tmp_path, read_shard_index_or_empty(tmp_path))
    assert temp_files(tmp_path) == []
    old_bytes = (tmp_path / relpath).read_bytes()

    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("core.files.atomic.os.replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        write_shard(tmp_path, relpath, make_rows(4, seed=1), split="train", source="lib",
                    tokenizer_sha256=TOKENIZER_SHA, vocab_size=VOCAB_SIZE)
    assert (tmp_path / relpath).read_bytes() == old_bytes
    assert temp_files(tmp_path) == []


def read_shard_index_or_empty(run_dir: Path) -> list[ShardInfo]:
    return read_shard_index(run_dir) if (run_dir / "shards" / "index.parquet").is_file() else []


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import numpy as np
    import core.files.atomic
    from core.shards.store import ShardRows, write_shard

    def kill_before_rename(fd):  # the new shard is fully written to its temp file, not yet renamed
        os.kill(os.getpid(), signal.SIGKILL)

    core.files.atomic.os.fsync = kill_before_rename
    ids = np.full((4, 16), 7, dtype=np.int64)
    rows = ShardRows(ids, [[1]] * 4, [[0]] * 4, [0] * 4, [16] * 4)
    write_shard(Path(sys.argv[1]), sys.argv[2], rows, split="train", source="lib", tokenizer_sha256="a" * 64,
                vocab_size=500)
""")


def test_a_killed_writer_leaves_the_old_shard_intact(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    relpath = infos[0].path
    old_bytes = (tmp_path / relpath).read_bytes()
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path), relpath], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == -9, result.stderr
    assert (tmp_path / relpath).read_bytes() == old_bytes
    leftovers = temp_files(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].parent == (tmp_path / relpath).parent
    assert verify_shards(tmp_path) == []  # a temp file is not a shard
    assert remove_stale_temps(tmp_path / "shards") == 1 and temp_files(tmp_path) == []


def test_same_input_gives_byte_identical_shards_and_index(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    infos_first, infos_second = write_run(first), write_run(second)
    assert infos_first == infos_second
    written = sorted(path.relative_to(first) for path in (first / "shards").rglob("*") if path.is_file())
    assert len(written) == 4  # three shards and the index
    for relpath in written:
        assert (first / relpath).read_bytes() == (second / relpath).read_bytes(), relpath


def test_verify_passes_on_an_intact_run(tmp_path: Path) -> None:
    write_run(tmp_path)
    assert verify_shards(tmp_path) == []


def test_verify_reports_a_flipped_byte(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    path = tmp_path / infos[1].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert verify_shards(tmp_path) == [f"{infos[1].path}: sha256 differs from the index (corrupted or modified)"]


def test_verify_reports_a_missing_and_an_extra_file(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    (tmp_path / infos[0].path).unlink()
    extra = shard_relpath("train", "lib", 7)
    shutil.copyfile(tmp_path / infos[1].path, tmp_path / extra)
    assert verify_shards(tmp_path) == [f"{extra}: shard file not in the index (extra file)",
                                       f"{infos[0].path}: listed in the index but missing on disk"]


def test_verify_reports_an_extra_column_although_the_sha_matches(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    batch = read_batch(tmp_path / infos[0].path)
    widened = batch.append_column("loss_mask", pa.array([True] * batch.num_rows))
    rewrite_with_index_sha(tmp_path, infos[0].path, widened.replace_schema_metadata(batch.schema.metadata))
    assert verify_shards(tmp_path) == [f"{infos[0].path}: schema differs from the shard contract"]


def test_verify_reports_int32_token_ids_although_the_sha_matches(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    batch = read_batch(tmp_path / infos[0].path)
    ids = batch.column("input_ids").values.cast(pa.int32())
    wide = pa.FixedSizeListArray.from_arrays(ids, type=pa.list_(pa.field("item", pa.int32(), nullable=False),
                                                                  SEQ_LEN))
    columns = [wide, *batch.columns[1:]]
    schema = batch.schema.set(0, pa.field("input_ids", wide.type, nullable=False))
    rewrite_with_index_sha(tmp_path, infos[0].path, pa.record_batch(columns, schema=schema))
    assert verify_shards(tmp_path) == [f"{infos[0].path}: schema differs from the shard contract"]


def test_verify_reports_a_shard_without_input_ids_instead_of_crashing(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    batch = read_batch(tmp_path / infos[0].path)
    rewrite_with_index_sha(tmp_path, infos[0].path, batch.drop_columns(["input_ids"]))
    assert verify_shards(tmp_path) == [f"{infos[0].path}: schema differs from the shard contract"]


def test_verify_reports_a_file_that_is_not_arrow(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    (tmp_path / infos[2].path).write_bytes(b"not an arrow file at all")
    write_shard_index(tmp_path, [dataclasses.replace(info, sha256=sha256_file(tmp_path / info.path))
                                 for info in infos])
    (fault,) = verify_shards(tmp_path)
    assert fault.startswith(f"{tmp_path / infos[2].path}: not a readable Arrow IPC shard")


def test_verify_reports_token_ids_beyond_the_vocab(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    relpath = infos[0].path
    # The writer records vocab_size 100 while ids go up to VOCAB_SIZE - 1: metadata, schema and sha agree.
    info = write_shard(tmp_path, relpath, make_rows(5), split="train", source="lib",
                       tokenizer_sha256=TOKENIZER_SHA, vocab_size=100)
    write_shard_index(tmp_path, [info, *infos[1:]])
    max_id = int(make_rows(5).input_ids.max())
    assert verify_shards(tmp_path) == [f"{relpath}: token id {max_id} >= vocab size 100"]


def test_verify_reports_metadata_and_row_count_disagreeing_with_the_index(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    wrong = dataclasses.replace(infos[0], source="web", num_rows=99)
    write_shard_index(tmp_path, [wrong, *infos[1:]])
    assert verify_shards(tmp_path) == [f"{infos[0].path}: metadata source='lib', index says 'web'",
                                       f"{infos[0].path}: 5 rows, index says 99"]


def test_verify_without_an_index_says_to_prepare(tmp_path: Path) -> None:
    with pytest.raises(ShardFormatError, match="run `tokenmill prepare` first"):
        verify_shards(tmp_path)


def test_reader_refuses_rows_that_are_not_fixed_size_token_lists(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    batch = read_batch(tmp_path / infos[0].path)
    ragged = pa.array(batch.column("input_ids").to_pylist(), type=pa.list_(pa.uint16()))
    schema = batch.schema.set(0, pa.field("input_ids", ragged.type, nullable=False))
    rewrite_with_index_sha(tmp_path, infos[0].path, pa.record_batch([ragged, *batch.columns[1:]], schema=schema))
    with pytest.raises(ShardFormatError, match=r"input_ids list<item: uint16>, expected fixed_size_list"):
        ShardTokens(tmp_path / infos[0].path)
    assert verify_shards(tmp_path) == [f"{infos[0].path}: schema differs from the shard contract"]


def test_verify_reports_non_numeric_metadata_instead_of_crashing(tmp_path: Path) -> None:
    infos = write_run(tmp_path)
    batch = read_batch(tmp_path / infos[0].path)
    metadata = {**batch.schema.metadata, b"vocab_size": b"lots"}
    rewrite_with_index_sha(tmp_path, infos[0].path, batch.replace_schema_metadata(metadata))
    assert verify_shards(tmp_path) == [
        f"{infos[0].path}: metadata vocab_size='lots', seq_len='{SEQ_LEN}' are not whole numbers"]
