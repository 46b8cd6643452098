"""A small chat corpus from the standard library's docstrings, with planted faults, and a run dir prepared from it by
``tokenmill prepare`` (the session fixture ``chat_run`` in conftest.py).

Each conversation asks what a stdlib function does and answers with its docstring's first paragraph (real text).
Planted: an exact copy of one conversation, a near copy of a long one (one word changed), one whose answer an eval
file holds (decontamination), one too long for ``pack.seq_len`` (``chat.truncation: error``), and records that are
not conversations (unknown role, no assistant turn, empty content, broken JSON). A second chat source is a Parquet
file (the table readers' path); the model is a ChatML tokenizer with Qwen's stock template (prefix-diff masks).
"""

from __future__ import annotations

import base64
import bisect
import colorsys
import fnmatch
import heapq
import inspect
import json
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from pipeline.filters.normalisation import normalise_text
from pipeline.filters.screen import content_hash, split_for
from tests.tokenization.chat import chat_tokenizers as ct

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
SEQ_LEN = 384
VAL_FRACTION = 0.2
MODULES = (json, textwrap, shlex, base64, fnmatch, heapq, bisect, colorsys)


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def docstring_answers(max_chars: int = 600) -> list[tuple[str, str]]:
    """``(question, answer)`` per documented public function of MODULES: what it does, and its docstring's first
    paragraph re-flowed (answers of 60 to ``max_chars`` chars)."""
    answers = []
    for module in MODULES:
        for name in sorted(vars(module)):
            function = getattr(module, name)
            doc = inspect.getdoc(function) if callable(function) and not name.startswith("_") else None
            answer = " ".join(doc.split("\n\n")[0].split()) if doc else ""
            if 60 <= len(answer) <= max_chars:
                answers.append((f"What does {module.__name__}.{name} do?", answer))
    return answers


def docstring_records() -> list[dict[str, Any]]:
    """One question/answer conversation per documented public function of MODULES (answers of 60 to 600 chars)."""
    return [{"messages": [user(question), assistant(answer)]} for question, answer in docstring_answers()]


def long_answer(num_words: int) -> str:
    """The first ``num_words`` words of json.dumps's whole docstring (real text, one paragraph)."""
    return " ".join(inspect.getdoc(json.dumps).split()[:num_words])


def is_train(record: dict[str, Any]) -> bool:
    """Whether ingest puts this conversation in the train split (decontamination checks train documents only)."""
    text = normalise_text("\n\n".join(message["content"] for message in record["messages"]))
    return split_for(content_hash(text), VAL_FRACTION) == "train"


@dataclass(frozen=True)
class ChatCorpus:
    lines: list[str]
    """The jsonl source's lines."""
    exact_copy_of: dict[str, Any]
    near_copy_of: dict[str, Any]
    near_copy: dict[str, Any]
    contaminated: dict[str, Any]
    too_long: dict[str, Any]
    bad: dict[int, str]
    """{line number (1-based): the ingest reject reason}."""
    parquet_records: list[dict[str, Any]]


def chat_corpus() -> ChatCorpus:
    records = docstring_records()
    near_copy_of = {"messages": [user("Summarise json.dumps."), assistant(long_answer(90))]}
    words = near_copy_of["messages"][1]["content"].split()
    words[45] = "EDITED"
    near_copy = {"messages": [user("Summarise json.dumps."), assistant(" ".join(words))]}
    contaminated = next(record for record in records[5:] if is_train(record)
                        and len(record["messages"][1]["content"].split()) >= 20)
    too_long = {"messages": [user("Quote json.dumps's documentation."), assistant(long_answer(400))]}
    lines = [json.dumps(record) for record in [*records, near_copy_of]]
    lines += [json.dumps(records[0]), json.dumps(near_copy), json.dumps(too_long),
              json.dumps({"prompt": "What is a tuple?", "completion": "An immutable sequence of values."})]
    bad_lines = [(json.dumps({"messages": [user("Hi"), {"role": "wizard", "content": "Abracadabra"}]}), "unknown_role"),
                 (json.dumps({"messages": [user("Is anyone there?")]}), "no_assistant_turn"),
                 (json.dumps({"messages": [user("   "), assistant("An empty question.")]}), "empty_content"),
                 ('{"messages": [', "invalid_json")]
    bad = {}
    for line, reason in bad_lines:
        lines.append(line)
        bad[len(lines)] = reason
    parquet_records = [{"messages": [user("What is a frozenset?"), assistant("An immutable, hashable set.")]},
                       {"messages": [user("What does zip do?"), assistant("It pairs items of several iterables.")]},
                       {"messages": [user("No answer here.")]}]
    return ChatCorpus(lines, records[0], near_copy_of, near_copy, contaminated, too_long, bad, parquet_records)


def write_model_dir(folder: Path, seq_len: int) -> Path:
    """A tiny Llama config beside a ChatML tokenizer with Qwen's stock template (prefix-diff masks) in ``folder``."""
    model = ct.save_model_dir(folder, ct.CHATML_FAMILY, ct.CHATML)
    vocab_size = len(json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]) + 16
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": seq_len}))
    return model


def write_recipe(root: Path, corpus: ChatCorpus, chat: dict[str, Any] | None = None) -> Path:
    """Model dir, chat sources, eval file, manifest and recipe under ``root``; returns the recipe."""
    write_model_dir(root / "model", SEQ_LEN)
    (root / "chat").mkdir()
    (root / "chat" / "docstrings.jsonl").write_text("\n".join(corpus.lines) + "\n")
    table = pa.Table.from_pylist(corpus.parquet_records)
    pq.write_table(table, root / "chat" / "more.parquet")
    (root / "eval.jsonl").write_text(json.dumps({"text": corpus.contaminated["messages"][1]["content"]}) + "\n")
    (root / "manifest.yaml").write_text(yaml.safe_dump({"name": "stdlib-chat", "sources": [
        {"name": "docstrings", "path": "chat/docstrings.jsonl", "format": "jsonl", "records": "chat"},
        {"name": "more", "path": "chat/more.parquet", "format": "parquet", "records": "chat"}]}))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "chat", "run_dir": str(root / "run"),
        "data": {"manifests": ["manifest.yaml"], "val_fraction": VAL_FRACTION},
        "dedupe": {"near": {"enabled": True, "threshold": 0.8, "num_perm": 128, "ngram": 5},
                   "decontaminate": {"enabled": True, "against_val": False, "eval_files": ["eval.jsonl"]}},
        "pack": {"seq_len": SEQ_LEN, "rows_per_shard": 4},
        "chat": chat or {"loss": "assistant", "truncation": "error"},
        "model": {"hf_config": "model"},
        "eval": {"enabled": False},
    }))
    return recipe


def tokenmill(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([TOKENMILL, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def prepare(recipe: Path) -> Path:
    """``tokenmill prepare`` on ``recipe`` (from its folder), which must succeed; returns the run dir beside it."""
    result = tokenmill("prepare", str(recipe), cwd=recipe.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return recipe.parent / "run"
