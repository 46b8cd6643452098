"""tokenization/sample.py: random rows of a real run, decoded, with their lineage and the documents' uris."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from core.errors import ConfigError
from core.shards.store import read_shard_index
from flows.run_sql import run_query
from tests.test_readme_sql import build_small_run
from tokenization.sample import sample_rows

EOS, PAD = "<|endoftext|>", "<|pad|>"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_small_run(tmp_path_factory.mktemp("sample"), packages=("json",))


@pytest.fixture(scope="module")
def documents(run_dir: Path) -> dict[int, dict]:
    table = run_query(run_dir, "SELECT doc_id, uri, text FROM documents")
    return {row["doc_id"]: row for row in table.to_pylist()}


def total_rows(run_dir: Path, split: str | None = None) -> int:
    return sum(info.num_rows for info in read_shard_index(run_dir) if split in (None, info.split))


def test_same_seed_same_rows_other_seed_other_rows(run_dir: Path) -> None:
    first = sample_rows(run_dir, 5, seed=3)
    assert sample_rows(run_dir, 5, seed=3) == first
    assert [(row["shard_path"], row["row"]) for row in sample_rows(run_dir, 5, seed=4)] != [
        (row["shard_path"], row["row"]) for row in first]
    assert len(first) == 5 and list(first[0]) == ["shard_path", "row", "split", "source", "num_tokens",
                                                  "num_pad_tokens", "first_doc_offset", "doc_ids", "doc_starts",
                                                  "uris", "text"]


def test_asking_for_more_rows_than_exist_gives_each_row_once(run_dir: Path) -> None:
    rows = sample_rows(run_dir, 10**6, decode=False)
    keys = [(row["shard_path"], row["row"]) for row in rows]
    assert len(keys) == len(set(keys)) == total_rows(run_dir)
    assert keys == sorted(keys)


def test_lineage_and_uris_match_the_shard_and_the_documents(run_dir: Path, documents: dict[int, dict]) -> None:
    for row in sample_rows(run_dir, 20, seed=1, decode=False):
        with pa.memory_map(str(run_dir / row["shard_path"])) as source:
            stored = ipc.open_file(source).read_all().slice(row["row"], 1).to_pylist()[0]
        assert (row["doc_ids"], row["doc_starts"], row["num_tokens"], row["first_doc_offset"]) == (
            stored["doc_ids"], stored["doc_starts"], stored["num_tokens"], stored["first_doc_offset"])
        assert row["input_ids"] == stored["input_ids"][:row["num_tokens"]]
        assert row["uris"] == [documents[doc_id]["uri"] for doc_id in row["doc_ids"]]


def test_decoded_rows_show_document_texts_between_visible_eos_tokens(run_dir: Path,
                                                                     documents: dict[int, dict]) -> None:
    rows = sample_rows(run_dir, 10**6, seed=0)
    multi_doc_rows = [row for row in rows if len(row["doc_ids"]) > 1]
    assert any(len(row["doc_ids"]) > 2 for row in multi_doc_rows), "short documents share a row"
    for row in multi_doc_rows:
        segments = row["text"].split(EOS)
        assert len(segments) >= len(row["doc_ids"])
        texts = [documents[doc_id]["text"] for doc_id in row["doc_ids"]]
        assert texts[0].endswith(segments[0])  # the first document may have begun in an earlier row
        assert segments[1:len(texts) - 1] == texts[1:-1]  # documents wholly inside the row decode exactly
        assert texts[-1].startswith(segments[len(texts) - 1].split(PAD)[0])


def test_padding_is_shown_compactly(run_dir: Path) -> None:
    rows = sample_rows(run_dir, 10**6, split="val")
    assert {row["split"] for row in rows} == {"val"}
    (padded,) = [row for row in rows if row["num_pad_tokens"]]  # the split's last row
    assert padded["text"].endswith(f"{EOS}{PAD}×{padded['num_pad_tokens']}")
    assert padded["num_tokens"] + padded["num_pad_tokens"] == 64


def test_filters_and_n_are_checked(run_dir: Path) -> None:
    assert len(sample_rows(run_dir, 3, source="stdlib", split="train")) == 3
    with pytest.raises(ConfigError, match=r"no shards with split='test'.*train/stdlib, val/stdlib"):
        sample_rows(run_dir, 3, split="test")
    with pytest.raises(ConfigError, match="n=0"):
        sample_rows(run_dir, 0)
