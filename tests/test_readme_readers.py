"""docs/querying.md's "Reading the shards with pyarrow, polars, datasets or DuckDB": each snippet, run on a real run.

Every snippet must give the numbers the shard index records (rows and tokens per split), and the page's
claim that ``datasets.Dataset.from_file`` cannot read a shard is held here too (it is why the helper exists).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow as pa
import pytest

from core.shards.store import read_shard_index
from tests.test_readme_sql import build_small_run, fenced_blocks, readme_section

SECTION = readme_section("Reading the shards with pyarrow, polars, datasets or DuckDB")
SNIPPETS = fenced_blocks(SECTION, "python")
READERS = ("pyarrow.dataset", "polars", "shards_as_dataset", "connect(run_dir)")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A run prepared by the real stages (ingest, dedupe, tokenizer, pack) on standard-library files."""
    yield build_small_run(tmp_path_factory.mktemp("readers"))


def index_totals(run_dir: Path) -> dict[str, tuple[int, int]]:
    """(rows, tokens) per split, from the shard index."""
    totals: dict[str, tuple[int, int]] = {}
    for info in read_shard_index(run_dir):
        rows, tokens = totals.get(info.split, (0, 0))
        totals[info.split] = (rows + info.num_rows, tokens + info.num_tokens)
    return totals


def run_snippet(reader: str, run_dir: Path) -> dict:
    (snippet,) = [snippet for snippet in SNIPPETS if reader in snippet]
    namespace: dict = {"run_dir": str(run_dir)}
    exec(compile(snippet, "README.md", "exec"), namespace)
    return namespace


def test_the_section_has_one_snippet_per_reader() -> None:
    assert len(SNIPPETS) == len(READERS)
    assert all(sum(reader in snippet for snippet in SNIPPETS) == 1 for reader in READERS)


def test_pyarrow_dataset_with_hive_partitioning(real_run: Path, capsys: pytest.CaptureFixture) -> None:
    val = run_snippet("pyarrow.dataset", real_run)["val"]
    assert (val.num_rows, int(val.column("num_tokens").to_numpy().sum())) == index_totals(real_run)["val"]
    assert set(val.column("source").to_pylist()) == {"stdlib"}  # from the source=... folders
    assert f"{val.num_rows} val rows" in capsys.readouterr().out


def test_polars_scan_ipc_with_hive_partitioning(real_run: Path) -> None:
    per_split = run_snippet("polars", real_run)["per_split"]
    found = {row["split"]: (row["rows"], row["tokens"]) for row in per_split.to_dicts()}
    assert found == index_totals(real_run)


def test_datasets_through_shards_as_dataset(real_run: Path) -> None:
    namespace = run_snippet("shards_as_dataset", real_run)
    train, batch = namespace["train"], namespace["batch"]
    assert isinstance(train, datasets.Dataset) and len(train) == index_totals(real_run)["train"][0]
    assert tuple(batch.shape) == (8, read_shard_index(real_run)[0].seq_len)
    assert batch.tolist() == [row["input_ids"] for row in train.select(range(8))]


def test_duckdb_through_tokenmills_views(real_run: Path) -> None:
    totals = run_snippet("connect(run_dir)", real_run)["totals"]
    assert {split: (rows, int(tokens)) for split, rows, tokens in totals} == index_totals(real_run)


def test_datasets_from_file_cannot_read_a_shard_as_the_readme_says(real_run: Path) -> None:
    shard = real_run / read_shard_index(real_run)[0].path
    with pytest.raises(pa.ArrowInvalid, match="metadata bytes"):
        datasets.Dataset.from_file(str(shard))
    assert "Expected to read … metadata bytes" in SECTION
