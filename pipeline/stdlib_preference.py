"""A built-in preference corpus from the built-in chat corpus: each question's right answer against a wrong one.

The worked DPO example (``configs/dpo.yaml``) continues from the SFT example's model, so its pairs ask the questions
that model was taught to answer (``data_manifests/python-stdlib-chat.jsonl``, the standard library's docstrings):
the prompt is a conversation up to its last assistant turn, ``chosen`` is that turn (the docstring's first
paragraph) and ``rejected`` is the same answer corrupted, in one of three ways taken in turn (record number mod 3):

- ``other_answer``: another function's answer, the one half the corpus away (a fluent reply about something else);
- ``shuffled``: the answer's words in a shuffled order (the right words, not a sentence);
- ``truncated``: the first half of the answer's words (a reply that stops mid-sentence).

The records are in TRL's conversational shape (``prompt``, ``chosen`` and ``rejected`` message lists), except every
tenth, which is in its plain shape (three strings): the chat corpus's prompt/completion records. Each keeps the chat
record's ``id`` (the documented name, unique) and says how its rejected side was made (``corruption``, a key the
reader ignores). The output is a pure function of the chat corpus (the shuffles are seeded by the record's id), so
the committed ``data_manifests/python-stdlib-preference.jsonl`` is rebuilt, byte for byte, by::

    python -m pipeline.stdlib_preference data_manifests/python-stdlib-preference.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

CHAT_CORPUS = Path(__file__).resolve().parents[1] / "data_manifests" / "python-stdlib-chat.jsonl"
CORRUPTIONS = ("other_answer", "shuffled", "truncated")
"""How a record's rejected side is made, by record number mod 3."""


def split_last_answer(record: dict[str, Any]) -> tuple[list[dict[str, str]] | str, str]:
    """(the prompt, the last assistant answer) of a chat record: messages before the last turn, or the plain
    prompt string of a prompt/completion record."""
    if "messages" not in record:
        return record["prompt"], record["completion"]
    messages = record["messages"]
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{record.get('id')}: the conversation does not end with an assistant turn")
    return messages[:-1], messages[-1]["content"]


def corrupt(kind: str, answer: str, record_id: str, other_answer: str) -> str:
    """The rejected answer of ``kind`` (:data:`CORRUPTIONS`); always a different text from ``answer``."""
    words = answer.split()
    if kind == "other_answer":
        corrupted = other_answer
    elif kind == "shuffled":
        shuffled = list(words)
        random.Random(record_id).shuffle(shuffled)  # a str seed is hashed with sha512: the same on every machine
        corrupted = " ".join(shuffled if shuffled != words else words[::-1])
    elif kind == "truncated":
        corrupted = " ".join(words[:max(1, len(words) // 2)])
    else:
        raise ValueError(f"unknown corruption {kind!r}; one of {CORRUPTIONS}")
    if corrupted == answer:
        raise ValueError(f"{record_id}: the {kind} corruption left the answer unchanged")
    return corrupted


def preference_records(chat_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One pair per chat record, in order: its last answer chosen, a corrupted one rejected."""
    split = [split_last_answer(record) for record in chat_records]
    answers = [answer for _, answer in split]
    records = []
    for number, (record, (prompt, answer)) in enumerate(zip(chat_records, split, strict=True)):
        kind = CORRUPTIONS[number % len(CORRUPTIONS)]
        other = answers[(number + len(answers) // 2) % len(answers)]
        rejected = corrupt(kind, answer, record["id"], other)
        if isinstance(prompt, str):  # TRL's plain shape
            records.append({"id": record["id"], "prompt": prompt, "chosen": answer, "rejected": rejected,
                            "corruption": kind})
        else:
            records.append({"id": record["id"], "prompt": prompt,
                            "chosen": [{"role": "assistant", "content": answer}],
                            "rejected": [{"role": "assistant", "content": rejected}], "corruption": kind})
    return records


def read_chat_records(path: Path = CHAT_CORPUS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def corpus_text(chat_path: Path = CHAT_CORPUS) -> str:
    """The pairs as JSON lines (UTF-8, one record a line, keys in a fixed order): what the committed file holds."""
    records = preference_records(read_chat_records(chat_path))
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.stdlib_preference",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path,
                        help="the JSON-lines file to write (data_manifests/python-stdlib-preference.jsonl)")
    parser.add_argument("--chat", type=Path, default=CHAT_CORPUS, help="the chat corpus to read (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out.write_text(corpus_text(args.chat), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
