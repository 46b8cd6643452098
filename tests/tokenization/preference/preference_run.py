"""A small preference corpus from the standard library's docstrings, with planted faults, and a run dir prepared from
it by ``tokenmill prepare`` (the session fixture ``preference_run`` in conftest.py).

Each pair asks what a stdlib function does: chosen answers with its docstring's first paragraph (real text), rejected
with another function's. The three shapes TRL reads are all there (conversational, plain strings, implicit prompt).
Planted: a second pair on one prompt (exact dedupe keeps one), a pair whose two sides each fit ``pack.seq_len`` but not
together (``too_many_tokens`` from the stage), a long pair whose sides differ only at their ends (the same once cut
under ``truncation: truncate``), and records that are not pairs (identical sides, an empty side, no
``rejected``, broken JSON). The model is a ChatML tokenizer with Qwen's stock template (prefix-diff masks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.tokenization.chat.chat_run import assistant, docstring_answers, long_answer, user, write_model_dir

SEQ_LEN = 384
VAL_FRACTION = 0.2


def pair_record(index: int, question: str, chosen: str, rejected: str) -> dict[str, Any]:
    """The pair in one of the three shapes, by ``index``: conversational, plain, implicit prompt."""
    if index % 3 == 0:
        return {"prompt": [user(question)], "chosen": [assistant(chosen)], "rejected": [assistant(rejected)]}
    if index % 3 == 1:
        return {"prompt": question, "chosen": chosen, "rejected": rejected}
    return {"chosen": [user(question), assistant(chosen)], "rejected": [user(question), assistant(rejected)]}


def other_answer(qa: list[tuple[str, str]], index: int) -> str:
    """The next answer that is not ``qa[index]``'s (two functions may share a docstring)."""
    return next(answer for _, answer in qa[index + 1:] + qa[:index] if answer != qa[index][1])


@dataclass(frozen=True)
class PreferenceCorpus:
    lines: list[str]
    """The jsonl source's lines."""
    pairs: list[dict[str, Any]]
    """The good pairs, in line order (the first ``len(pairs)`` lines)."""
    same_prompt: dict[str, Any]
    """A second pair on the prompt of ``pairs[0]``: removed by exact dedupe (the prompt is the document's text)."""
    too_long: dict[str, Any]
    """Each side fits ``pack.seq_len``, the two together do not: ``too_many_tokens`` (``truncation: error``)."""
    same_once_cut: dict[str, Any]
    """Too long, and its sides differ only at their ends: ``identical_sides`` once cut (``truncation: truncate``)."""
    bad: dict[int, str]
    """{line number (1-based): the ingest reject reason}."""


def preference_corpus() -> PreferenceCorpus:
    qa = docstring_answers(max_chars=400)
    pairs = [pair_record(index, question, answer, other_answer(qa, index))
             for index, (question, answer) in enumerate(qa)]
    first_question = qa[0][0]
    same_prompt = {"prompt": [user(first_question)], "chosen": [assistant(qa[2][1])],
                   "rejected": [assistant(qa[3][1])]}
    too_long = {"prompt": [user("Quote json.dumps's documentation twice.")],
                "chosen": [assistant(long_answer(50))],
                "rejected": [assistant(" ".join(reversed(long_answer(45).split())))]}  # differs from its first word
    shared = long_answer(120)
    same_once_cut = {"prompt": [user("Quote json.dumps's documentation, then say if it is right.")],
                     "chosen": [assistant(shared + " Right.")], "rejected": [assistant(shared + " Wrong.")]}
    lines = [json.dumps(record) for record in [*pairs, same_prompt, too_long, same_once_cut]]
    bad_lines = [
        (json.dumps({"prompt": "Which is right?", "chosen": "This one.", "rejected": "This one."}), "identical_sides"),
        (json.dumps({"prompt": [user("Anyone?")], "chosen": [assistant("Yes.")], "rejected": []}), "empty_side"),
        (json.dumps({"prompt": "Only one side?", "chosen": "Yes, only this one."}), "bad_record"),
        ('{"prompt": "cut', "invalid_json"),
    ]
    bad = {}
    for line, reason in bad_lines:
        lines.append(line)
        bad[len(lines)] = reason
    return PreferenceCorpus(lines, pairs, same_prompt, too_long, same_once_cut, bad)


def write_recipe(root: Path, corpus: PreferenceCorpus, chat: dict[str, Any] | None = None) -> Path:
    """Model dir, preference source, manifest and recipe under ``root``; returns the recipe."""
    write_model_dir(root / "model", SEQ_LEN)
    (root / "pairs.jsonl").write_text("\n".join(corpus.lines) + "\n")
    (root / "manifest.yaml").write_text(yaml.safe_dump({"name": "stdlib-preference", "sources": [
        {"name": "pairs", "path": "pairs.jsonl", "format": "jsonl", "records": "preference"}]}))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "preference", "run_dir": str(root / "run"),
        "data": {"manifests": ["manifest.yaml"], "val_fraction": VAL_FRACTION},
        # near dedupe off: the prompts share their wording ("What does X do?"), so MinHash would pair some
        "dedupe": {"near": {"enabled": False}},
        "pack": {"seq_len": SEQ_LEN, "rows_per_shard": 4},
        "chat": chat or {"truncation": "error"},
        "model": {"hf_config": "model"},
        "eval": {"enabled": False},
    }))
    return recipe
