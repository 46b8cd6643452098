"""Ingest of a ``records: preference`` source: every reader (jsonl, parquet, hf_local, hf_disk) turns each of TRL's
preference shapes into a document whose ``text`` is the prompt and whose ``record`` is the normalised pair, a bad pair
into a reject with its reason, and exact dedupe reads the prompt (two pairs on one prompt keep one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import ManifestError
from core.schemas import CHAT_DOCUMENTS_SCHEMA, NON_FILTER_REJECT_REASONS
from core.stage import run_stage
from flows.run_sql import run_query
from pipeline.config import DedupeConfig
from pipeline.dedupe.stage import DedupeStage
from tests.pipeline.test_chat_ingest import ingest
from tokenization.preference.records import PREFERENCE_REJECT_REASONS


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


USER = message("user", "What does textwrap.dedent do?")
CHOSEN = message("assistant", "Remove any common leading whitespace from every line in text.")
REJECTED = message("assistant", "It indents every line of the text by four spaces.")
NORMALISED = {"prompt": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]}
"""What every good record below normalises to (each shape of one pair)."""

GOOD_LISTS: list[dict[str, Any]] = [
    {"prompt": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]},  # conversational, explicit prompt
    {"messages": [USER], "chosen": [CHOSEN], "rejected": [REJECTED]},  # the prompt under 'messages'
    {"chosen": [USER, CHOSEN], "rejected": [USER, REJECTED]},  # implicit prompt: the shared prefix
]
PLAIN = {"prompt": USER["content"], "chosen": CHOSEN["content"], "rejected": REJECTED["content"]}
BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [CHOSEN]}, "identical_sides"),
    ({"prompt": [USER], "chosen": [CHOSEN], "rejected": [message("assistant", "  ")]}, "empty_side"),
    ({"prompt": [USER], "chosen": [CHOSEN]}, "bad_record"),  # no 'rejected'
    ({"prompt": [USER], "chosen": [message("oracle", "Yes.")], "rejected": [REJECTED]}, "unknown_role"),
]


def write_source(tmp_path: Path, file_format: str, records: list[dict[str, Any]]) -> str:
    """The records as one file (or dataset folder) of ``file_format``; returns its path relative to tmp_path."""
    if file_format == "parquet":
        keys = ("prompt", "messages", "chosen", "rejected")  # null where a record has none: read as absent
        pq.write_table(pa.Table.from_pylist([{key: record.get(key) for key in keys} for record in records]),
                       tmp_path / "pairs.parquet")
        return "pairs.parquet"
    if file_format == "hf_disk":
        keys = ("prompt", "messages", "chosen", "rejected")
        table = {key: [record.get(key) for record in records] for key in keys}
        datasets.Dataset.from_dict(table).save_to_disk(tmp_path / "pairs")
        return "pairs"
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return "pairs.jsonl"


@pytest.mark.parametrize("file_format", ["jsonl", "parquet", "hf_local", "hf_disk"])
def test_each_reader_keeps_each_shape_and_rejects_bad_pairs_with_their_reason(tmp_path: Path,
                                                                               file_format: str) -> None:
    # lists and strings cannot share a typed column (datasets turns such a column into JSON text): the plain
    # shape goes in the jsonl file only
    records = [*GOOD_LISTS, *(record for record, _ in BAD)]
    if file_format == "jsonl":
        records.insert(0, PLAIN)
    path = write_source(tmp_path, file_format, records)
    paths, _ = ingest(tmp_path, [{"name": "pairs", "path": path, "format": file_format, "records": "preference"}])
    (part,) = paths.docs.glob("part-*.parquet")
    assert pq.read_schema(part).equals(CHAT_DOCUMENTS_SCHEMA)
    kept = run_query(paths.root, "SELECT text, record FROM _docs ORDER BY uri").to_pylist()
    assert len(kept) == len(records) - len(BAD)  # _docs: before dedupe, every good shape is a document
    for row in kept:
        assert row["text"] == USER["content"]  # the prompt: what dedupe and decontamination read
        assert json.loads(row["record"]) == NORMALISED
    rejects = run_query(paths.root, "SELECT reason, detail FROM rejects").to_pylist()
    assert sorted(row["reason"] for row in rejects) == sorted(reason for _, reason in BAD)
    assert all(row["detail"] and "\n" not in row["detail"] for row in rejects)
    assert next(row["detail"] for row in rejects if row["reason"] == "bad_record").startswith("the record has no "
                                                                                            "'rejected'")


def test_two_pairs_on_one_prompt_dedupe_to_one(tmp_path: Path) -> None:
    other = {"prompt": [USER], "chosen": [REJECTED], "rejected": [message("assistant", "Nothing at all.")]}
    third = {"prompt": [message("user", "What does shlex.quote do?")], "chosen": [CHOSEN], "rejected": [REJECTED]}
    path = write_source(tmp_path, "jsonl", [GOOD_LISTS[0], other, third])
    paths, _ = ingest(tmp_path, [{"name": "pairs", "path": path, "format": "jsonl", "records": "preference"}])
    run_stage(DedupeStage(paths, DedupeConfig()))
    prompts = sorted(run_query(paths.root, "SELECT text FROM documents").column("text").to_pylist())
    assert prompts == ["What does shlex.quote do?", USER["content"]]
    (duplicate,) = run_query(paths.root, "SELECT kind, uri FROM duplicates").to_pylist()
    assert duplicate == {"kind": "exact", "uri": "pairs.jsonl:2"}


def test_preference_reasons_are_documented_reject_reasons() -> None:
    assert PREFERENCE_REJECT_REASONS.items() <= NON_FILTER_REJECT_REASONS.items()


def test_preference_records_need_a_format_with_fields(tmp_path: Path) -> None:
    from pipeline.manifest import load_manifest

    manifest = tmp_path / "manifest.yaml"
    manifest.write_text("name: m\nsources:\n- {name: pairs, path: x, format: text, records: preference}\n")
    with pytest.raises(ManifestError, match="records: preference needs a format whose records have fields"):
        load_manifest(manifest)
