"""Hostile run dirs: whoever made a run dir, opening it runs nothing from it and reads nothing outside it.

Folder names, index rows and metadata are data: ``tokenmill query``/``report`` and ``flows.run_sql.connect``
refuse a ``shards/`` tree tokenmill would not write (one line naming the folder) before any SQL runs; an index
path that is absolute, holds ``..`` or leaves the run dir through a symlink is a ``verify`` fault and is refused
by the loader, ``shards stats`` and ``shards sample``. Run dirs are hand-built (``build_query_run``) and then
copied, as a run dir passed between teams is.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from core.documents import document_part_files
from core.errors import QueryError, RunDirError, ShardFormatError
from core.rundir import RunPaths
from core.schemas import REJECTS_SCHEMA
from core.shards.store import ShardRows, read_shard_index, verify_shards, write_shard, write_shard_index
from flows.report.stage import write_report
from flows.run_sql import connect
from pipeline.shard_stats import shard_stats
from tests.chaos.conftest import tokenmill
from tests.conftest import build_query_run
from tokenization.sample import sample_rows
from trainer.loader.batches import PAD_ID, SplitRows

SHARD = "shards/split=train/source=a/part-00000.arrow"
"""The one shard :func:`build_query_run` writes."""


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run dir as someone else hands it over: built, then copied to another folder."""
    original = build_query_run(tmp_path / "original")
    return Path(shutil.copytree(original, tmp_path / "received"))


def sql_folder_name(secret: str, target: str) -> str:
    """The issue's folder name: closes the old UNION ALL's string literal, then COPYs file ``secret`` to ``target``.

    Bare file names, relative to the working directory (a name of absolute paths spelled with ``chr(47)``, as
    in the issue, passes 255 bytes under pytest's tmp_path).
    """
    return (f"split=0' AS split, '' AS source, '' AS shard_path FROM _shard_0; COPY (SELECT content FROM "
            f"read_text('{secret}')) TO ('{target}'); --")


def plant_hostile_folder(run_dir: Path, workdir: Path) -> tuple[str, Path]:
    """The reproduction of issue item 1: the run's shard copied into ``shards/<sql>/source=y/``.

    Returns the folder name and the file its SQL would write (in ``workdir``, where the reader runs).
    """
    (workdir / "secret.txt").write_text("host-secret\n")
    name = sql_folder_name("secret.txt", "PWNED.csv")
    plant_shard(run_dir, f"shards/{name}/source=y/part-00000.arrow")
    return name, workdir / "PWNED.csv"


def plant_shard(run_dir: Path, relpath: str) -> Path:
    """A copy of the run's real shard at ``relpath`` (folders made as needed)."""
    path = run_dir / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / SHARD, path)
    return path


def one_error_line(result_stderr: str) -> str:
    lines = [line for line in result_stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result_stderr
    return lines[0]


# ---- item 1: nothing from disk is SQL ------------------------------------------------------------


@pytest.mark.parametrize("command", [["query", "SELECT count(*) FROM documents"], ["report"]], ids=["query", "report"])
def test_sql_in_a_shard_folder_name_runs_nothing_through_the_cli(run_dir: Path, tmp_path: Path,
                                                                 command: list[str]) -> None:
    name, target = plant_hostile_folder(run_dir, tmp_path)
    result = tokenmill(command[0], run_dir, *command[1:], cwd=tmp_path)
    assert not target.exists(), "the folder name was executed as SQL"
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert f"shards/{name}" in line and "split=train or split=val" in line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (run_dir / "report").exists()


def test_sql_in_a_shard_folder_name_runs_nothing_through_connect(run_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name, target = plant_hostile_folder(run_dir, tmp_path)
    with pytest.raises(QueryError) as refused:
        connect(run_dir)
    assert not target.exists()
    assert f"shards/{name}" in str(refused.value)
    assert any(f"shards/{name}" in fault for fault in verify_shards(run_dir))


LAYOUT_VARIANTS = {
    "quote in a source name": ("shards/split=train/source=a'b/part-00000.arrow", "shards/split=train/source=a'b"),
    "semicolon in a source name": ("shards/split=train/source=a;DROP/part-00000.arrow",
                                   "shards/split=train/source=a;DROP"),
    "newline in a source name": ("shards/split=train/source=a\nb/part-00000.arrow", "shards/split=train/source=a\nb"),
    "split not train or val": ("shards/split=test/source=a/part-00000.arrow", "shards/split=test"),
    "= inside a split name": ("shards/split=train=x/source=a/part-00000.arrow", "shards/split=train=x"),
    "= inside a source name": ("shards/split=train/source=a=b/part-00000.arrow", "shards/split=train/source=a=b"),
    "folder without key=": ("shards/split=train/a/part-00000.arrow", "shards/split=train/a"),
    "nested extra folder": ("shards/split=train/source=a/extra/part-00000.arrow", "shards/split=train/source=a/extra"),
    "extra level above": ("shards/extra/split=train/source=a/part-00000.arrow", "shards/extra"),
    "shard beside the source folders": ("shards/split=train/part-00000.arrow", "shards/split=train/part-00000.arrow"),
    "misnamed shard": ("shards/split=train/source=a/evil.arrow", "shards/split=train/source=a/evil.arrow"),
}


@pytest.mark.parametrize(("planted", "named"), LAYOUT_VARIANTS.values(), ids=LAYOUT_VARIANTS.keys())
def test_a_shards_tree_tokenmill_would_not_write_is_refused_naming_the_folder(run_dir: Path, planted: str,
                                                                              named: str) -> None:
    plant_shard(run_dir, planted)
    with pytest.raises(QueryError) as refused:
        connect(run_dir)
    message = str(refused.value)
    assert repr(named) in message and "\n" not in message
    assert any(repr(named) in fault for fault in verify_shards(run_dir))


def test_a_symlinked_shard_pointing_outside_the_run_dir_is_not_read(run_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / "part-00000.arrow"
    outside.parent.mkdir()
    shutil.copyfile(run_dir / SHARD, outside)
    link = run_dir / "shards/split=train/source=b/part-00000.arrow"
    link.parent.mkdir()
    link.symlink_to(outside)
    with pytest.raises(QueryError, match="outside the run dir") as refused:
        connect(run_dir)
    assert repr("shards/split=train/source=b/part-00000.arrow") in str(refused.value)
    assert any("outside the run dir" in fault for fault in verify_shards(run_dir))


def test_a_symlinked_split_folder_pointing_outside_the_run_dir_is_not_read(run_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    (outside / "source=a").mkdir(parents=True)
    shutil.copyfile(run_dir / SHARD, outside / "source=a" / "part-00000.arrow")
    (run_dir / "shards/split=val").symlink_to(outside, target_is_directory=True)
    with pytest.raises(QueryError, match="outside the run dir") as refused:
        connect(run_dir)
    assert repr("shards/split=val") in str(refused.value)


def test_a_symlink_that_stays_inside_the_run_dir_is_followed(run_dir: Path) -> None:
    link = run_dir / "shards/split=val/source=a/part-00000.arrow"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("../../split=train/source=a/part-00000.arrow"))
    [info] = read_shard_index(run_dir)  # the index lists it (sequences reads only shards it vouches for)
    write_shard_index(run_dir, [info, dataclasses.replace(info, path=link.relative_to(run_dir).as_posix(),
                                                          split="val")])
    rows = connect(run_dir).sql("SELECT split, count(*) FROM sequences GROUP BY split ORDER BY split").fetchall()
    assert rows == [("train", 2), ("val", 2)]


def test_an_arrow_file_that_is_not_arrow_is_refused_naming_it(run_dir: Path) -> None:
    broken = run_dir / "shards/split=val/source=a/part-00000.arrow"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"PAR1 this is not an Arrow IPC file")
    with pytest.raises(QueryError, match="not a readable Arrow IPC shard") as refused:
        connect(run_dir)
    assert str(broken) in str(refused.value)


def test_a_shard_with_other_columns_is_refused_naming_it(run_dir: Path) -> None:
    odd = run_dir / "shards/split=val/source=a/part-00000.arrow"
    odd.parent.mkdir(parents=True)
    table = pa.table({"input_ids": [1], "split": ["x"]})
    with ipc.new_file(odd, table.schema) as out:
        out.write_table(table)
    with pytest.raises(QueryError, match="not written by tokenmill's packer") as refused:
        connect(run_dir)
    assert str(odd) in str(refused.value)


def test_a_fifo_named_like_a_shard_is_refused_without_blocking(run_dir: Path) -> None:
    fifo = run_dir / "shards/split=val/source=a/part-00000.arrow"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    # Through the CLI with a timeout: opening a FIFO blocks until a writer comes, which would hang this process.
    result = tokenmill("query", run_dir, "SELECT count(*) FROM sequences", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert repr("shards/split=val/source=a/part-00000.arrow") in line and "not a regular file" in line


def test_a_document_part_symlinked_outside_the_run_dir_is_not_read(run_dir: Path, tmp_path: Path) -> None:
    part = run_dir / "docs/part-00000.parquet"
    outside = tmp_path / "elsewhere.parquet"
    shutil.move(part, outside)
    part.symlink_to(outside)
    with pytest.raises((QueryError, RunDirError), match="outside the run dir") as refused:
        connect(run_dir)
    assert str(part) in str(refused.value)
    with pytest.raises(RunDirError, match="outside the run dir"):  # the stages that read documents refuse it too
        document_part_files(RunPaths(run_dir))


def test_metrics_rows_of_mixed_types_are_one_line_naming_the_file(run_dir: Path) -> None:
    metrics = run_dir / "metrics/train.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": "one; DROP TABLE x", "loss": 1.0}\n')
    with pytest.raises(QueryError, match="rows do not form one table") as refused:
        connect(run_dir)
    assert str(metrics) in str(refused.value) and "\n" not in str(refused.value)


def test_sql_in_shard_metadata_is_only_data(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Metadata is never pasted anywhere (this also held before the fix: a guard, not a reproduction)."""
    monkeypatch.chdir(run_dir)
    target = run_dir / "PWNED.csv"
    payload = sql_folder_name(SHARD, "PWNED.csv")
    rows = ShardRows(np.arange(8, dtype=np.uint16).reshape(1, 8), [[3]], [[0]], [0], [8])
    info = write_shard(run_dir, "shards/split=train/source=b/part-00000.arrow", rows, split=payload, source=payload,
                       tokenizer_sha256=payload, vocab_size=100)
    # listed in the index, as the packer would (sequences reads only shards the index vouches for)
    write_shard_index(run_dir, [*read_shard_index(run_dir), dataclasses.replace(info, split="train", source="b")])
    con = connect(run_dir)
    assert con.sql("SELECT source, count(*) FROM sequences GROUP BY source ORDER BY source").fetchall() == [
        ("a", 2), ("b", 1)]
    assert not target.exists()


def test_sequences_over_many_shards_keep_rows_splits_and_sources(tmp_path: Path) -> None:
    """The rebuilt view: every shard's rows, row numbers and folders, as the index and the files say."""
    run = tmp_path / "run"
    infos = []
    for relpath, split, source, num_rows in [("shards/split=train/source=a/part-00000.arrow", "train", "a", 5),
                                             ("shards/split=train/source=a/part-00001.arrow", "train", "a", 2),
                                             ("shards/split=train/source=b.v2/part-00000.arrow", "train", "b.v2", 3),
                                             ("shards/split=val/source=a/part-00000.arrow", "val", "a", 1)]:
        tokens = (np.arange(num_rows * 8, dtype=np.uint16) + len(infos) * 100).reshape(num_rows, 8)
        rows = ShardRows(tokens, [[1]] * num_rows, [[0]] * num_rows, [0] * num_rows, [8] * num_rows)
        infos.append(write_shard(run, relpath, rows, split=split, source=source, tokenizer_sha256="t" * 64,
                                 vocab_size=1000))
    write_shard_index(run, infos)
    con = connect(run)
    got = con.sql("SELECT shard_path, any_value(split), any_value(source), count(*), max(row_in_shard), "
                  "sum(num_tokens) FROM sequences GROUP BY shard_path ORDER BY shard_path").fetchall()
    assert got == [(i.path, i.split, i.source, i.num_rows, i.num_rows - 1, i.num_tokens) for i in sorted(
        infos, key=lambda info: info.path)]
    assert con.sql("SELECT input_ids[1], typeof(split) FROM sequences WHERE shard_path = ? AND row_in_shard = 1",
                   params=["shards/split=train/source=a/part-00001.arrow"]).fetchall() == [(108, "VARCHAR")]
    assert verify_shards(run) == []


# ---- item 2: every path an index names stays inside the run dir -----------------------------------


def rewrite_index_path(run_dir: Path, path: str, **changes: str) -> None:
    """Replace the index's one row's ``path`` (and any other column) and write the index back."""
    [info] = read_shard_index(run_dir)
    write_shard_index(run_dir, [dataclasses.replace(info, path=path, **changes)])


def move_shard_outside(run_dir: Path, destination: Path) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(run_dir / SHARD, destination)
    return destination


def assert_readers_refuse(run_dir: Path, expected: str) -> None:
    """The loader, ``shards stats`` and ``shards sample`` refuse the index with one line holding ``expected``."""
    for read in (lambda: SplitRows(run_dir, "train", PAD_ID), lambda: shard_stats(run_dir),
                 lambda: sample_rows(run_dir, 1, decode=False)):
        with pytest.raises(ShardFormatError) as refused:
            read()
        assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_an_absolute_index_path_to_an_identical_shard_elsewhere_is_a_verify_fault(run_dir: Path,
                                                                                   tmp_path: Path) -> None:
    elsewhere = move_shard_outside(run_dir, tmp_path / "elsewhere" / SHARD)
    rewrite_index_path(run_dir, str(elsewhere))
    faults = verify_shards(run_dir)
    assert faults == [f"index path {str(elsewhere)!r} is an absolute path"]
    assert_readers_refuse(run_dir, "is an absolute path")


def test_a_dotdot_index_path_is_refused_by_the_loader_and_shards_sample(run_dir: Path, tmp_path: Path) -> None:
    move_shard_outside(run_dir, tmp_path / "elsewhere" / "part-00000.arrow")
    escaping = "shards/../../elsewhere/part-00000.arrow"
    rewrite_index_path(run_dir, escaping)
    assert_readers_refuse(run_dir, f"index path {escaping!r} contains '..'")
    result = tokenmill("shards", "sample", run_dir, "--n", "1", "--no-decode")
    assert result.returncode == 2, result.stdout + result.stderr
    assert escaping in one_error_line(result.stderr)
    assert any("contains '..'" in fault for fault in verify_shards(run_dir))


def test_an_index_path_symlinked_outside_the_run_dir_is_refused(run_dir: Path, tmp_path: Path) -> None:
    outside = move_shard_outside(run_dir, tmp_path / "elsewhere" / "part-00000.arrow")
    (run_dir / SHARD).symlink_to(outside)  # the index (sha256 and all) still matches the file it reaches
    expected = f"index path {SHARD!r} resolves (through a symlink) outside the run dir"
    assert verify_shards(run_dir) == [repr(SHARD) + " resolves (through a symlink) outside the run dir", expected]
    assert_readers_refuse(run_dir, expected)


def test_index_columns_that_disagree_with_the_path_are_refused(run_dir: Path) -> None:
    rewrite_index_path(run_dir, SHARD, split="val")
    assert_readers_refuse(run_dir, "lies in split=train/source=a, the row says split='val'")
    assert verify_shards(run_dir) == [f"{SHARD}: metadata split='train', index says 'val'"]


# ---- what the report does with hostile names -------------------------------------------------------


def test_hostile_source_and_reason_names_are_text_in_the_report(run_dir: Path) -> None:
    source, reason = "<img src=x onerror=alert(1)>$\\undefined{$", "[click](javascript:alert(1))|`x`"
    pq.write_table(pa.table({"source": [source], "source_id": [None], "uri": ["h.jsonl:2"], "reason": [reason],
                             "detail": ["d"], "raw": [b"{oops"], "text": [None]}, schema=REJECTS_SCHEMA),
                   run_dir / "rejects/part-00000.parquet")
    index = write_report(RunPaths(run_dir))  # before the fix: matplotlib parsed the name as a formula and raised
    markdown = (index.parent / "report.md").read_text()
    assert "<img" not in markdown and "[click](" not in markdown and "|`x`" not in markdown
    assert "&lt;img src=x onerror=alert(1)&gt;" in markdown and "\\[click\\](javascript:alert(1))\\|\\`x\\`" in markdown
    assert "<img src=x" not in index.read_text()


def test_rich_markup_in_a_record_is_printed_as_it_is(run_dir: Path) -> None:
    """The terminal table shows data as text: a uri holding rich markup neither crashes it nor styles it."""
    hostile = "[/][link=file:///etc/passwd]click[/link][bold red]x"
    part = run_dir / "docs/part-00000.parquet"
    table = pq.read_table(part)
    uris = table.column("uri").to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("uri"), "uri",
                                    pa.array([hostile, *uris[1:]])), part)
    result = tokenmill("query", str(run_dir), "SELECT uri FROM documents WHERE uri LIKE '[%' ")
    assert result.returncode == 0, result.stderr
    assert hostile in result.stdout
