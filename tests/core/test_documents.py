"""core/documents.py: split/source-aware reading returns exactly what filtering after a full read returns,
and never decompresses the text of row groups it does not need."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.documents import DUPLICATES_FILE, iter_documents, wanted_row_groups
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA
from tests.conftest import finish_docs_part


def document_rows(num_rows: int, part: int) -> list[dict]:
    return [{"doc_id": part * 1000 + i, "source": ("a", "b")[i % 3 == 0], "source_id": None, "uri": f"u{part}-{i}",
             "text": f"text {part} {i} " * (i % 7 + 1), "num_chars": 0, "content_hash": str(i),
             "split": "val" if i % 5 == 0 else "train"} for i in range(num_rows)]


def write_part(paths: RunPaths, part: int, groups: list[list[dict]]) -> None:
    """A finished documents part with the given row groups."""
    path = paths.docs / f"part-{part:05d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, DOCUMENTS_SCHEMA) as writer:
        for rows in groups:
            writer.write_table(pa.Table.from_pylist(rows, schema=DOCUMENTS_SCHEMA))
    finish_docs_part(paths.root, part)


@pytest.fixture
def run(tmp_path: Path) -> RunPaths:
    """Part 0 mixes splits in its row groups (as ingest wrote them before), part 1 keeps each split apart."""
    paths = RunPaths(tmp_path)
    mixed = document_rows(50, 0)
    write_part(paths, 0, [mixed[:20], mixed[20:]])
    rows = document_rows(60, 1)
    write_part(paths, 1, [[r for r in rows[:30] if r["split"] == "train"], [r for r in rows if r["split"] == "val"],
                          [r for r in rows[30:] if r["split"] == "train"]])
    removed = [3, 10, 1005, 1011, 1012]
    paths.dedupe.mkdir(parents=True)
    pq.write_table(pa.table({"doc_id": pa.array(removed, pa.int64())}), paths.dedupe / DUPLICATES_FILE)
    return paths


def filtered_after_full_read(paths: RunPaths, split: str | None, source: str | None) -> list[dict]:
    """The reference: every row read, then filtered (what iter_documents did before it read row groups apart)."""
    removed = set(pq.read_table(paths.dedupe / DUPLICATES_FILE).column("doc_id").to_pylist())
    rows = [row for part in sorted(paths.docs.glob("part-*.parquet")) for row in pq.read_table(part).to_pylist()]
    return [row for row in rows if row["doc_id"] not in removed and split in (None, row["split"])
            and source in (None, row["source"])]


@pytest.mark.parametrize("split", [None, "train", "val"])
@pytest.mark.parametrize("source", [None, "a", "b", "c"])
@pytest.mark.parametrize("batch_rows", [1, 7, 1024])
def test_reading_a_split_returns_exactly_the_filtered_documents_in_order(
        run: RunPaths, split: str | None, source: str | None, batch_rows: int) -> None:
    batches = list(iter_documents(run, split=split, source=source, columns=["doc_id", "text", "split"],
                                  batch_rows=batch_rows))
    assert all(0 < batch.num_rows <= batch_rows for batch in batches)
    got = [row for batch in batches for row in batch.to_pylist()]
    expected = filtered_after_full_read(run, split, source)
    assert got == [{"doc_id": row["doc_id"], "text": row["text"], "split": row["split"]} for row in expected]
    assert all(batch.schema.names == ["doc_id", "text", "split"] for batch in batches)


def test_all_columns_by_default(run: RunPaths) -> None:
    rows = [row for batch in iter_documents(run, split="val") for row in batch.to_pylist()]
    assert rows == filtered_after_full_read(run, "val", None)


def test_the_val_pack_never_decompresses_train_only_text(run: RunPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    """Part 1 (60 rows) keeps each split in row groups of its own: reading val reads the text of its val row group
    only, and the statistics spare even the key columns of its train row groups."""
    reads: list[tuple[int, int, tuple[str, ...]]] = []
    read_row_group = pq.ParquetFile.read_row_group

    def spy(self: pq.ParquetFile, group: int, columns: list[str] | None = None, **kwargs: object) -> pa.Table:
        reads.append((self.metadata.num_rows, group, tuple(columns or ())))
        return read_row_group(self, group, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    assert list(iter_documents(run, split="val", columns=["doc_id", "text"]))
    assert {(group, "text" in columns) for num_rows, group, columns in reads if num_rows == 60} == {(1, False),
                                                                                                  (1, True)}
    assert {(group, "text" in columns) for num_rows, group, columns in reads if num_rows == 50} == {
        (0, False), (0, True), (1, False), (1, True)}  # part 0 mixes the splits: both row groups hold val rows


def test_row_group_statistics_rule_out_other_splits_and_sources(run: RunPaths) -> None:
    metadata = pq.ParquetFile(run.docs / "part-00001.parquet").metadata
    assert wanted_row_groups(metadata, split="val") == [1]
    assert wanted_row_groups(metadata, split="train") == [0, 2]
    assert wanted_row_groups(metadata, source="c") == []
    assert wanted_row_groups(metadata) == [0, 1, 2]
