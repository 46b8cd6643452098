"""pipeline/stdlib_preference.py: the built-in preference corpus is what the generator makes from the committed chat
corpus, every record is a pair tokenmill's preference parser accepts, and each rejected side is the corruption it
names."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from pipeline import stdlib_preference
from tokenization.preference.records import PreferencePair, parse_pair

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "data_manifests" / "python-stdlib-preference.yaml"
CORPUS = REPO / "data_manifests" / "python-stdlib-preference.jsonl"
CHAT = REPO / "data_manifests" / "python-stdlib-chat.jsonl"


def corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


def test_the_committed_pairs_are_what_the_generator_makes_from_the_chat_corpus() -> None:
    assert CORPUS.read_text(encoding="utf-8") == stdlib_preference.corpus_text(CHAT), \
        "rebuild it: python -m pipeline.stdlib_preference data_manifests/python-stdlib-preference.jsonl"
    assert CORPUS.stat().st_size < 1_000_000


def test_every_record_is_a_pair_in_trls_conversational_or_plain_shape() -> None:
    records = corpus()
    pairs = [parse_pair(record) for record in records]
    assert [(record["id"], pair) for record, pair in zip(records, pairs, strict=True)
            if not isinstance(pair, PreferencePair)] == []
    formats = Counter(pair.record_format for pair in pairs)
    assert formats == {"conversational": len(records) - len(records) // 10, "plain": len(records) // 10}
    chat_ids = [json.loads(line)["id"] for line in CHAT.read_text(encoding="utf-8").splitlines()]
    assert [record["id"] for record in records] == chat_ids, "one pair per conversation, in order"
    assert Counter(record["corruption"] for record in records) == {
        kind: len(records) // 3 for kind in stdlib_preference.CORRUPTIONS}


def test_chosen_is_the_conversations_last_reply_and_rejected_its_named_corruption() -> None:
    records = {record["id"]: record for record in corpus()}
    chat = {record["id"]: record for record in map(json.loads, CHAT.read_text(encoding="utf-8").splitlines())}
    answers = {name: stdlib_preference.split_last_answer(record)[1] for name, record in chat.items()}
    for name, record in records.items():
        pair = parse_pair(record)
        chosen, rejected = pair.chosen[0].content, pair.rejected[0].content
        assert chosen == answers[name] and rejected != chosen
        if record["corruption"] == "shuffled":
            assert sorted(rejected.split()) == sorted(chosen.split())
        elif record["corruption"] == "truncated":
            assert chosen.startswith(rejected) and len(rejected.split()) == max(1, len(chosen.split()) // 2)
        else:
            assert rejected in answers.values()
    two_rounds = records["abc.abstractproperty"]  # the prompt keeps the first round, question and answer
    assert [message["role"] for message in two_rounds["prompt"]] == ["user", "assistant", "user"]
    assert two_rounds["chosen"] == [{"role": "assistant",
                                     "content": "Recalculate the set of abstract methods of an abstract class."}]


def test_a_corruption_always_changes_the_answer_or_says_it_cannot() -> None:
    for seed in ("a", "b", "c", "d"):  # whichever order a seed gives, two words come out swapped
        assert stdlib_preference.corrupt("shuffled", "one two", seed, "other") == "two one"
    assert stdlib_preference.corrupt("truncated", "one two three four", "x", "other") == "one two"
    for kind, answer, other in (("shuffled", "same same", "x"), ("other_answer", "same", "same"),
                                ("reversed", "one two", "x")):
        with pytest.raises(ValueError, match=kind):
            stdlib_preference.corrupt(kind, answer, "x", other)


def test_the_manifest_reads_the_committed_file_as_preference_records() -> None:
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    (source,) = manifest["sources"]
    assert (MANIFEST.parent / source["path"]).resolve() == CORPUS.resolve()
    assert (source["format"], source["records"], source["id_field"]) == ("jsonl", "preference", "id")
    shortest = min(len(parse_pair(record).prompt_text) for record in corpus())
    assert manifest["filters"]["min_chars"] <= shortest, "the length filter reads the prompt: it must keep them all"
