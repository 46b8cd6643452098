"""trainer.model.sample_generation: the prompt comes from the run's own validation text; no export, nothing to do."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import TokenmillError
from core.rundir import RunPaths
from core.schemas import DOCUMENTS_SCHEMA
from trainer.model.sample_generation import PROMPT_CHARS, sample_is_current, sample_prompt, write_sample_generation


def write_documents(run: Path, texts_and_splits: list[tuple[str, str]]) -> RunPaths:
    paths = RunPaths(run)
    paths.docs.mkdir(parents=True)
    rows = len(texts_and_splits)
    pq.write_table(pa.table({
        "doc_id": list(range(1, rows + 1)), "source": ["a"] * rows, "source_id": [None] * rows,
        "uri": [f"f{i}.py" for i in range(rows)], "text": [text for text, _ in texts_and_splits],
        "num_chars": [len(text) for text, _ in texts_and_splits], "content_hash": [f"h{i}" for i in range(rows)],
        "split": [split for _, split in texts_and_splits]}, schema=DOCUMENTS_SCHEMA), paths.docs / "part-00000.parquet")
    paths.write_json(paths.marker("ingest", "part-00000"), {"fingerprint": "x", "summary": {}})
    return paths


def test_the_prompt_is_the_first_line_of_the_first_validation_document(tmp_path: Path) -> None:
    long_line = "def a_rather_long_function_name(first_argument, second_argument):"
    paths = write_documents(tmp_path, [("import os\nimport sys", "train"), (f"{long_line}\n    pass", "val")])
    assert sample_prompt(paths) == long_line[:PROMPT_CHARS]


def test_without_validation_documents_the_prompt_is_a_train_one_and_without_any_empty(tmp_path: Path) -> None:
    assert sample_prompt(write_documents(tmp_path / "a", [("import os\nimport sys", "train")])) == "import os"
    assert sample_prompt(RunPaths(tmp_path / "empty")) == ""


def test_without_an_export_there_is_nothing_to_sample(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    assert sample_is_current(paths)
    with pytest.raises(TokenmillError, match="no exported model"):
        write_sample_generation(paths)
