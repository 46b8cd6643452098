"""Chat sources through ``tokenmill prepare`` (one run per session: tests/tokenization/chat/chat_run.py): conversations
are ingested as documents with their record, deduplicated and decontaminated like text, rendered and masked into chat
shards that the index lists, every bad record in rejects with its reason, and queryable token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import yaml

from core.conversations import CHAT_REJECT_REASONS, Conversation, parse_record
from core.rundir import RunPaths
from core.shards.store import read_shard_index, verify_shards
from flows.run_sql import run_query
from pipeline.sql.query import data_funnel
from tests.tokenization.chat.chat_run import SEQ_LEN, ChatCorpus, chat_corpus, tokenmill, write_recipe
from tokenization.chat.masks import MaskedConversation, mask_conversation
from tokenization.chat.template import load_chat_template

ChatRun = tuple[Path, ChatCorpus]


def documents(run: Path) -> dict[str, dict]:
    """Kept documents by their conversation's normalised JSON."""
    return {row["record"]: row for row in run_query(run, "SELECT * FROM documents").to_pylist()}


def normalised(record: dict) -> str:
    conversation = parse_record(record)
    assert isinstance(conversation, Conversation)
    return conversation.normalised_json()


def test_conversations_are_documents_with_their_record_and_text(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    kept = documents(run)
    row = kept[normalised(corpus.exact_copy_of)]
    assert row["text"] == "\n\n".join(message["content"] for message in corpus.exact_copy_of["messages"])
    assert json.loads(row["record"]) == {"messages": corpus.exact_copy_of["messages"]}
    prompt_completion = next(row for row in kept.values() if row["text"].startswith("What is a tuple?"))
    assert json.loads(prompt_completion["record"]) == {
        "prompt": [{"role": "user", "content": "What is a tuple?"}],
        "completion": [{"role": "assistant", "content": "An immutable sequence of values."}]}
    assert {row["source"] for row in kept.values()} == {"docstrings", "more"}  # the Parquet source too


def test_exact_and_near_copies_are_dropped_and_a_contaminated_one_is(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    kept = documents(run)
    duplicates = run_query(run, "SELECT kind, uri, duplicate_of FROM duplicates").to_pylist()
    lines = {json.dumps(json.loads(line)): number for number, line in enumerate(corpus.lines, start=1)
             if not line.startswith('{"messages": [') or line.endswith("}")}
    exact_uri = f"docstrings.jsonl:{max(n for line, n in lines.items() if json.loads(line) == corpus.exact_copy_of)}"
    near_uri = f"docstrings.jsonl:{lines[json.dumps(corpus.near_copy)]}"
    assert ("exact", exact_uri) in {(row["kind"], row["uri"]) for row in duplicates}
    assert ("near", near_uri) in {(row["kind"], row["uri"]) for row in duplicates}
    assert normalised(corpus.exact_copy_of) in kept and normalised(corpus.near_copy) not in kept
    assert normalised(corpus.contaminated) not in kept
    contaminated = run_query(run, "SELECT uri FROM rejects WHERE reason = 'contaminated'").column("uri").to_pylist()
    assert contaminated == [f"docstrings.jsonl:{lines[json.dumps(corpus.contaminated)]}"]


def test_records_that_are_not_conversations_are_ingest_rejects_with_their_reason(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    rows = run_query(run, "SELECT source, uri, reason, detail, raw FROM rejects").to_pylist()
    by_uri = {row["uri"]: row for row in rows}
    for line, reason in corpus.bad.items():
        row = by_uri[f"docstrings.jsonl:{line}"]
        assert (row["reason"], row["raw"]) == (reason, corpus.lines[line - 1].encode())
        assert row["detail"] and "\n" not in row["detail"]
    assert by_uri["more.parquet#row=2"]["reason"] == "no_assistant_turn"


def test_a_conversation_too_long_for_seq_len_is_a_stage_reject(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    paths = RunPaths(run)
    (row,) = pq.read_table(paths.sft_rejects("train", "docstrings")).to_pylist()
    assert row["reason"] == "too_many_tokens" and f"longer than {SEQ_LEN} (seq_len)" in row["detail"]
    assert json.loads(row["raw"]) == json.loads(normalised(corpus.too_long))
    assert normalised(corpus.too_long) in documents(run)  # kept by ingest: the stage decides, and says why


def test_chat_shards_are_indexed_and_hold_every_kept_conversation_with_masks_py_masks(chat_run: ChatRun) -> None:
    run, _ = chat_run
    paths = RunPaths(run)
    infos = read_shard_index(run)
    assert {(info.split, info.source) for info in infos} >= {("train", "docstrings"), ("train", "more")}
    template = load_chat_template(paths.base_model)
    expected: dict[int, MaskedConversation] = {}
    rejected = set(run_query(run, "SELECT uri FROM rejects WHERE reason = 'too_many_tokens'").column("uri").to_pylist())
    for row in run_query(run, "SELECT doc_id, uri, record FROM documents").to_pylist():
        if row["uri"] not in rejected:
            masked = mask_conversation(template, parse_record(json.loads(row["record"])), "assistant", SEQ_LEN)
            assert isinstance(masked, MaskedConversation)
            expected[row["doc_id"]] = masked
    seen = {}
    for info in infos:
        with ipc.open_file(run / info.path) as reader:
            assert reader.schema.names[-2:] == ["loss_mask", "num_loss_tokens"]
            for row in reader.read_all().to_pylist():
                ends = [*row["doc_starts"][1:], row["num_tokens"]]
                for doc_id, start, end in zip(row["doc_ids"], row["doc_starts"], ends, strict=True):
                    assert doc_id not in seen
                    seen[doc_id] = (row["input_ids"][start:end], row["loss_mask"][start:end])
                assert row["num_loss_tokens"] == sum(row["loss_mask"])
    assert seen.keys() == expected.keys()  # every kept conversation, once
    for doc_id, masked in expected.items():
        assert seen[doc_id] == (masked.input_ids, [0, *masked.loss_mask[1:]]), doc_id
    assert verify_shards(run) == []
    state = json.loads(paths.pack_state("train", "docstrings").read_text())
    assert state["chat_template"] == template.text


def test_pack_leaves_chat_sources_to_the_chat_stage(chat_run: ChatRun) -> None:
    paths = RunPaths(chat_run[0])
    assert not paths.marker("pack", "split=train/source=docstrings").exists()
    assert paths.marker("sft_data", "split=train/source=docstrings").is_file()


def test_sequences_and_sft_tokens_show_what_trained(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    totals = run_query(run, "SELECT sum(num_loss_tokens) AS loss, sum(list_sum(loss_mask)) AS mask "
                            "FROM sequences").to_pylist()[0]
    assert totals["loss"] == totals["mask"] > 0
    record = normalised(corpus.exact_copy_of)
    doc_id = next(row["doc_id"] for row in documents(run).values() if row["record"] == record)
    tokens = run_query(run, f"SELECT position, token_id, token, trained FROM sft_tokens WHERE doc_id = {doc_id} "
                            "ORDER BY position").to_pylist()
    assert [row["position"] for row in tokens] == list(range(len(tokens)))
    trained = "".join(row["token"] for row in tokens if row["trained"])
    assert trained == corpus.exact_copy_of["messages"][1]["content"] + "<|im_end|>"


def test_the_sft_cookbook_queries_run(chat_run: ChatRun) -> None:
    run, _ = chat_run
    text = (Path(__file__).resolve().parents[3] / "docs" / "querying.md").read_text(encoding="utf-8")
    section = text.split("\n## SFT cookbook\n", 1)[1].split("\n## ", 1)[0]
    queries = [block.split("```", 1)[0] for block in section.split("```sql\n")[1:]]
    assert len(queries) >= 2
    for sql in queries:
        assert run_query(run, sql).num_rows >= 1, sql


def test_status_lists_the_chat_units_done(chat_run: ChatRun) -> None:
    run, _ = chat_run
    result = tokenmill("status", str(run), str(run.parent / "recipe.yaml"), "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = [row for row in json.loads(result.stdout)["units"] if row["stage"] == "sft_data"]
    assert {(row["unit"], row["state"]) for row in rows} == {
        (f"split={split}/source={source}", "done") for split in ("train", "val") for source in ("docstrings", "more")}


def test_a_template_the_tokenizer_cannot_render_is_one_error_line(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, chat_corpus(), chat={"template_file": "other.jinja"})
    (tmp_path / "other.jinja").write_text("{% for m in messages %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}")
    result = tokenmill("prepare", str(recipe), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr  # a bad recipe, as every ConfigError
    assert len(result.stderr.strip().splitlines()) == 1 and "<|end|>, <|turn|>" in result.stderr
    assert "other.jinja" in result.stderr
    assert not (tmp_path / "run" / "docs").exists()  # before any work
    assert yaml.safe_load(recipe.read_text())["chat"] == {"template_file": "other.jinja"}


def test_the_funnel_counts_each_record_once_and_the_report_says_what_a_chat_reject_means(chat_run: ChatRun) -> None:
    run, corpus = chat_run
    funnel = {row["source"]: row for row in data_funnel(run)}
    assert funnel["docstrings"]["records_read"] == len(corpus.lines)  # a stage reject is a document too
    assert funnel["more"]["records_read"] == len(corpus.parquet_records)
    report = (run / "report" / "report.md").read_text(encoding="utf-8")
    assert "| too_many_tokens | 1 |" in report and CHAT_REJECT_REASONS["too_many_tokens"] in report
    assert CHAT_REJECT_REASONS["unknown_role"] in report
