"""Ingest of a ``records: chat`` source: every reader (jsonl, parquet, hf_local) turns a conversation into a document
whose ``text`` is its contents and whose ``record`` is its normalised JSON, and a record that is not a conversation
into a reject with its reason; a filtered conversation brought back by a relaxed threshold gets its record again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from core.errors import ManifestError
from core.rundir import RunPaths
from core.schemas import CHAT_DOCUMENTS_SCHEMA, DOCUMENTS_SCHEMA
from flows.run_sql import run_query
from pipeline.ingest.stage import ingest_part, plan_ingest
from pipeline.manifest import load_manifest

GOOD: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What does textwrap.dedent do?"},
                  {"role": "assistant", "content": "Remove any common leading whitespace from every line in text."}]},
    {"prompt": "What does shlex.quote do?", "completion": "Return a shell-escaped version of the string s."},
]
BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "oracle", "content": "Hello"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": "Anyone?"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "An empty question."}]},
     "empty_content"),
    ({"text": "a text record in a chat source"}, "bad_record"),
]


def expected_documents() -> dict[str, str]:
    """{document text: its record} of GOOD."""
    first, second = GOOD
    return {"\n\n".join(message["content"] for message in first["messages"]):
            json.dumps({"messages": first["messages"]}, sort_keys=True, separators=(",", ":")),
            f"{second['prompt']}\n\n{second['completion']}":
            json.dumps({"prompt": [{"role": "user", "content": second["prompt"]}],
                        "completion": [{"role": "assistant", "content": second["completion"]}]},
                       sort_keys=True, separators=(",", ":"))}


def ingest(root: Path, sources: list[dict[str, Any]], filters: dict[str, Any] | None = None) -> tuple[RunPaths, Path]:
    manifest = root / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"name": "chat", "sources": sources, "filters": filters or {}}))
    paths = RunPaths(root / "run")
    paths.root.mkdir(exist_ok=True)
    for part in plan_ingest([manifest], paths, 1 << 20):
        ingest_part(part, 0.0, paths)
    return paths, manifest


@pytest.mark.parametrize("file_format", ["jsonl", "parquet", "hf_local"])
def test_each_reader_keeps_conversations_and_rejects_the_rest_with_their_reason(tmp_path: Path,
                                                                                 file_format: str) -> None:
    records = [*GOOD, *(record for record, _ in BAD)]
    if file_format == "parquet":
        path = tmp_path / "chat.parquet"  # columns messages, prompt, completion, text: null where a record has none
        keys = ("messages", "prompt", "completion", "text")
        pq.write_table(pa.Table.from_pylist([{key: record.get(key) for key in keys} for record in records]), path)
    else:
        path = tmp_path / "chat.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    paths, _ = ingest(tmp_path, [{"name": "chat", "path": path.name, "format": file_format, "records": "chat"}])
    (part,) = paths.docs.glob("part-*.parquet")
    assert pq.read_schema(part).equals(CHAT_DOCUMENTS_SCHEMA)
    kept = {row["text"]: row["record"]
            for row in run_query(paths.root, "SELECT text, record FROM documents").to_pylist()}
    assert kept == expected_documents()
    reasons = sorted(run_query(paths.root, "SELECT reason FROM rejects").column("reason").to_pylist())
    assert reasons == sorted(reason for _, reason in BAD)


def test_a_text_source_keeps_the_documents_schema_beside_a_chat_source(tmp_path: Path) -> None:
    (tmp_path / "chat.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    (tmp_path / "notes.txt").write_text("Plain text, one document per file, as before.\n")
    paths, _ = ingest(tmp_path, [{"name": "chat", "path": "chat.jsonl", "format": "jsonl", "records": "chat"},
                                 {"name": "notes", "path": "notes.txt", "format": "text"}])
    schemas = {pq.read_table(part, columns=["source"]).column("source")[0].as_py(): pq.read_schema(part)
               for part in paths.docs.glob("part-*.parquet")}
    assert schemas["notes"].equals(DOCUMENTS_SCHEMA) and schemas["chat"].equals(CHAT_DOCUMENTS_SCHEMA)
    rows = run_query(paths.root, "SELECT source, record IS NULL AS no_record FROM documents").to_pylist()
    assert sorted((row["source"], row["no_record"]) for row in rows) == [("chat", False), ("notes", True)]


def test_a_conversation_a_relaxed_threshold_brings_back_has_its_record(tmp_path: Path) -> None:
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(record) + "\n" for record in GOOD))
    source = {"name": "chat", "path": "chat.jsonl", "format": "jsonl", "records": "chat"}
    paths, manifest = ingest(tmp_path, [source], {"min_chars": 90})
    assert run_query(paths.root, "SELECT reason FROM rejects").column("reason").to_pylist() == ["too_short"]
    manifest.write_text(manifest.read_text().replace("min_chars: 90", "min_chars: 1"))
    summaries = [ingest_part(part, 0.0, paths) for part in plan_ingest([manifest], paths, 1 << 20)]
    assert all(summary["redecided"] for summary in summaries)
    kept = {row["text"]: row["record"]
            for row in run_query(paths.root, "SELECT text, record FROM documents").to_pylist()}
    assert kept == expected_documents()


def test_chat_records_need_a_format_with_fields(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"name": "m", "sources": [
        {"name": "chat", "path": "x", "format": "text", "records": "chat"}]}))
    with pytest.raises(ManifestError, match="records: chat needs a format whose records have fields"):
        load_manifest(manifest)
