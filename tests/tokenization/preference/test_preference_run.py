"""Preference sources through ``tokenmill prepare`` (one run per session: conftest.py): pairs are ingested as
documents whose text is the prompt, deduplicated on it, rendered, masked and packed into preference shards that the
index lists and ``shards verify`` passes, every bad pair in rejects with its reason, the report saying what each
reason means."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import yaml

from core.preference_pairs import PREFERENCE_REJECT_REASONS, PreferencePair, parse_pair
from core.rundir import RunPaths
from core.shards.preference import is_preference_shard, row_pairs
from core.shards.store import read_shard_index, verify_shards
from flows.run_sql import run_query
from pipeline.sql.query import data_funnel
from tests.tokenization.chat.chat_run import tokenmill
from tests.tokenization.preference.preference_run import SEQ_LEN, PreferenceCorpus, preference_corpus, write_recipe
from tokenization.chat.template import load_chat_template
from tokenization.preference.masks import MaskedPair, mask_pair

PreferenceRun = tuple[Path, PreferenceCorpus]


def normalised(record: dict) -> str:
    pair = parse_pair(record)
    assert isinstance(pair, PreferencePair), pair
    return pair.normalised_json()


def documents(run: Path) -> dict[str, dict]:
    """Kept documents by their pair's normalised JSON."""
    return {row["record"]: row for row in run_query(run, "SELECT * FROM documents").to_pylist()}


def test_pairs_are_documents_whose_text_is_the_prompt(preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    kept = documents(run)
    for record in corpus.pairs:  # conversational, plain and implicit-prompt shapes alike
        row = kept[normalised(record)]
        prompt = json.loads(row["record"])["prompt"]
        assert row["text"] == prompt[0]["content"] and prompt[0]["role"] == "user"
        assert set(json.loads(row["record"])) == {"prompt", "chosen", "rejected"}
    assert len(kept) == len(corpus.pairs) + 2  # and the too-long pairs: the stage rejects them, ingest keeps them


def test_a_second_pair_on_one_prompt_is_an_exact_duplicate(preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    (row,) = run_query(run, "SELECT kind, uri FROM duplicates").to_pylist()
    assert row == {"kind": "exact", "uri": f"pairs.jsonl:{len(corpus.pairs) + 1}"}
    assert normalised(corpus.same_prompt) not in documents(run)


def test_records_that_are_not_pairs_are_ingest_rejects_with_their_reason(preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    by_uri = {row["uri"]: row for row in run_query(run, "SELECT uri, reason, detail, raw FROM rejects").to_pylist()}
    for line, reason in corpus.bad.items():
        row = by_uri[f"pairs.jsonl:{line}"]
        assert (row["reason"], row["raw"]) == (reason, corpus.lines[line - 1].encode())
        assert row["detail"] and "\n" not in row["detail"]


def test_a_pair_too_long_for_one_row_is_a_stage_reject(preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    masked = mask_pair(load_chat_template(RunPaths(run).base_model), parse_pair(corpus.too_long))
    assert isinstance(masked, MaskedPair)
    sides = len(masked.chosen.input_ids), len(masked.rejected.input_ids)
    assert max(sides) <= SEQ_LEN < sum(sides)  # each side fits alone: the pair does not
    rows = [row for split in ("train", "val")
            for row in pq.read_table(RunPaths(run).preference_rejects(split, "pairs")).to_pylist()]
    assert sorted(row["uri"] for row in rows) == [f"pairs.jsonl:{len(corpus.pairs) + n}" for n in (2, 3)]
    row = next(row for row in rows if json.loads(row["raw"]) == json.loads(normalised(corpus.too_long)))
    assert row["reason"] == "too_many_tokens"
    assert f"{sides[0]} + {sides[1]} = {sum(sides)} tokens" in row["detail"] and f"{SEQ_LEN} (seq_len)" in row["detail"]
    assert normalised(corpus.too_long) in documents(run)  # kept by ingest: the stage decides, and says why


def shard_pairs(run: Path) -> dict[int, tuple[list[int], list[int], list[int], list[int]]]:
    """{doc id: (chosen ids, chosen mask, rejected ids, rejected mask)} of every pair in the indexed shards."""
    seen: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
    for info in read_shard_index(run):
        assert is_preference_shard(run / info.path)
        with ipc.open_file(run / info.path) as reader:
            for row in reader.read_all().to_pylist():
                for pair in row_pairs(row["doc_ids"], row["doc_starts"], row["num_tokens"]):
                    assert pair.doc_id not in seen
                    (c0, c1), (r0, r1) = pair.chosen, pair.rejected
                    seen[pair.doc_id] = (row["input_ids"][c0:c1], row["loss_mask"][c0:c1],
                                         row["input_ids"][r0:r1], row["loss_mask"][r0:r1])
    return seen


def test_preference_shards_hold_every_kept_pair_with_loss_on_each_completion_only(
        preference_run: PreferenceRun) -> None:
    run, _ = preference_run
    paths = RunPaths(run)
    template = load_chat_template(paths.base_model)
    rejected = set(run_query(run, "SELECT uri FROM rejects WHERE reason = 'too_many_tokens'").column("uri").to_pylist())
    expected: dict[int, MaskedPair] = {}
    records = {}
    for row in run_query(run, "SELECT doc_id, uri, record FROM documents").to_pylist():
        records[row["doc_id"]] = row["record"]
        if row["uri"] not in rejected:
            masked = mask_pair(template, parse_pair(json.loads(row["record"])))
            assert isinstance(masked, MaskedPair)
            expected[row["doc_id"]] = masked
    seen = shard_pairs(run)
    assert seen.keys() == expected.keys()  # every kept pair, once, both sides under its doc id
    for doc_id, masked in expected.items():
        chosen_ids, chosen_mask, rejected_ids, rejected_mask = seen[doc_id]
        assert (chosen_ids, rejected_ids) == (masked.chosen.input_ids, masked.rejected.input_ids)
        prompt = masked.num_prompt_tokens
        assert chosen_ids[:prompt] == rejected_ids[:prompt]  # one prompt, rendered once per side
        assert chosen_mask == [0, *masked.chosen.loss_mask[1:]] and not any(chosen_mask[:prompt])
        assert rejected_mask == [0, *masked.rejected.loss_mask[1:]] and not any(rejected_mask[:prompt])
        pair = json.loads(records[doc_id])
        for side, ids, mask in (("chosen", chosen_ids, chosen_mask), ("rejected", rejected_ids, rejected_mask)):
            trained = template.tokenizer.decode([token for token, bit in zip(ids, mask, strict=True) if bit])
            assert trained == pair[side][0]["content"] + "<|im_end|>"  # the completion and its end of turn, only
    assert verify_shards(run) == []
    state = json.loads(paths.pack_state("train", "pairs").read_text())
    assert state["chat_template"] == template.text and state["kind"] == "preference"


def test_pack_and_the_sft_stage_leave_preference_sources_alone(preference_run: PreferenceRun) -> None:
    paths = RunPaths(preference_run[0])
    unit = "split=train/source=pairs"
    assert not paths.marker("pack", unit).exists() and not paths.marker("sft_data", unit).exists()
    assert paths.marker("preference_data", unit).is_file()


def test_status_lists_the_preference_units_done(preference_run: PreferenceRun) -> None:
    run, _ = preference_run
    result = tokenmill("status", str(run), str(run.parent / "recipe.yaml"), "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = [row for row in json.loads(result.stdout)["units"] if row["stage"] == "preference_data"]
    assert {(row["unit"], row["state"]) for row in rows} == {
        ("split=train/source=pairs", "done"), ("split=val/source=pairs", "done")}


def test_the_funnel_counts_each_record_once_and_the_report_says_what_a_pair_reject_means(
        preference_run: PreferenceRun) -> None:
    run, corpus = preference_run
    (funnel,) = data_funnel(run)
    assert funnel["records_read"] == len(corpus.lines)  # a stage reject is a document too
    assert funnel["rejected"] == len(corpus.bad)
    report = (run / "report" / "report.md").read_text(encoding="utf-8")
    assert "| too_many_tokens | 2 |" in report and PREFERENCE_REJECT_REASONS["too_many_tokens"] in report
    assert "| identical_sides | 1 |" in report and PREFERENCE_REJECT_REASONS["identical_sides"] in report


def test_preference_sources_without_a_model_to_render_them_are_one_error_line(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, preference_corpus())
    settings = yaml.safe_load(recipe.read_text())
    del settings["model"]  # the built-in model: no chat template to render pairs with
    settings["tokenizer"] = {"vocab_size": 512}
    recipe.write_text(yaml.safe_dump(settings))
    result = tokenmill("prepare", str(recipe), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "sources ['pairs'] have records: preference" in result.stderr and "model.from_pretrained" in result.stderr
    assert not (tmp_path / "run" / "docs").exists()  # before any work
