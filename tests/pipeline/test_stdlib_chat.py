"""pipeline/stdlib_chat.py: the built-in chat corpus is what the generator makes, deterministic, and every record is
a conversation tokenmill's chat parser accepts."""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import yaml

from pipeline import stdlib_chat
from tokenization.chat.records import Conversation, parse_record

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "data_manifests" / "python-stdlib-chat.yaml"
CORPUS = REPO / "data_manifests" / "python-stdlib-chat.jsonl"


def test_the_committed_corpus_is_what_the_generator_makes() -> None:
    made = stdlib_chat.corpus_text()
    assert made == stdlib_chat.corpus_text(), "the same Python gives the same bytes"
    if sys.version_info[:2] == stdlib_chat.BUILT_WITH:
        assert CORPUS.read_text(encoding="utf-8") == made, \
            "rebuild it: python -m pipeline.stdlib_chat data_manifests/python-stdlib-chat.jsonl"
    else:  # another Python's docstrings differ: the committed file still holds as many records of the same form
        assert len(CORPUS.read_text(encoding="utf-8").splitlines()) > 500


def test_every_record_is_a_conversation_in_one_of_the_two_formats() -> None:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    conversations = [parse_record(record) for record in records]
    rejected = [(record["id"], result) for record, result in zip(records, conversations, strict=True)
                if not isinstance(result, Conversation)]
    assert rejected == []
    formats = Counter(conversation.record_format for conversation in conversations)
    assert formats["prompt_completion"] == len(records) // 10 and formats["messages"] > 800
    shapes = Counter(tuple(message.role for message in conversation.messages) for conversation in conversations)
    assert set(shapes) == {("user", "assistant"), ("system", "user", "assistant"),
                           ("user", "assistant", "user", "assistant"),
                           ("system", "user", "assistant", "user", "assistant")}
    assert len({record["id"] for record in records}) == len(records), "each record names its own documented name"
    assert CORPUS.stat().st_size < 1_000_000


def test_a_question_is_answered_by_the_first_paragraph_of_its_own_docstring() -> None:
    records = {record["id"]: record for record in map(json.loads, CORPUS.read_text(encoding="utf-8").splitlines())}
    messages = records["json.dumps"]["messages"]
    assert messages[-2:] == [{"role": "user", "content": "What does `json.dumps` do?"},
                             {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."}]


def test_signatures_and_one_word_docstrings_are_not_answers() -> None:
    assert stdlib_chat.first_paragraph("isqrt(n, /, *, exact=True) -> int, the integer root\n\nReturn it.") is None
    assert stdlib_chat.first_paragraph("Return x.") is None
    assert stdlib_chat.first_paragraph("x" * 700) is None
    assert stdlib_chat.first_paragraph("""Split the string into words,
        keeping quoted parts whole.

        More details follow here.""") == "Split the string into words, keeping quoted parts whole."


def test_an_inherited_docstring_is_not_an_answer_and_each_answer_appears_once() -> None:
    source = textwrap.dedent('''
        __all__ = ["Shape", "Square", "unit_square", "other_square"]

        class Shape:
            """A plane figure with an area and a perimeter."""

            def area(self):
                """Return the area of the figure, in square units."""

            def _cached(self):
                """A private helper that nobody should be asked about."""

        class Square(Shape):
            def area(self):  # overrides without a docstring: inspect.getdoc would answer with Shape.area's
                return 1

        def unit_square():
            """Return a square whose sides are one unit long."""

        def other_square():
            """Return a square whose sides are one unit long."""

        def not_exported():
            """Defined here but left out of __all__, so not public."""
    ''')
    entries = list(stdlib_chat.source_entries("shapes", source))
    assert [(entry.name, entry.kind) for entry in entries] == [
        ("shapes.Shape", "class"), ("shapes.Shape.area", "method"), ("shapes.unit_square", "function"),
        ("shapes.other_square", "function")]
    json_entries = stdlib_chat.stdlib_entries(("json", "json"))
    assert json_entries == stdlib_chat.stdlib_entries(("json",)), "a repeated answer is kept once"


def test_the_corpus_is_read_from_source_not_from_what_imports_replaced() -> None:
    import inspect

    original = inspect.getfile
    try:
        inspect.getfile = lambda obj: "patched"  # as torch.package does when torch is imported
        entries = stdlib_chat.stdlib_entries(("inspect",))
    finally:
        inspect.getfile = original
    assert "inspect.getfile" in {entry.name for entry in entries}


def test_the_manifest_reads_the_committed_file_as_chat_records() -> None:
    manifest = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    (source,) = manifest["sources"]
    assert (MANIFEST.parent / source["path"]).resolve() == CORPUS.resolve()
    assert (source["format"], source["records"], source["id_field"]) == ("jsonl", "chat", "id")
