"""Next-line task (after dedupe): kept validation documents -> ``tokenmill_next_line.{yaml,jsonl}``, an lm-eval task.

A built-in downstream task that needs no download: each item shows a few consecutive lines of one validation
document (never trained on) and asks which line comes next. The choices are the true next line and lines of
other validation documents of similar length, so chance accuracy is ``1 / num_choices`` (0.25 with the
default four choices). The written folder is a plain lm-eval task: ``lm_eval --include_path FOLDER --tasks
tokenmill_next_line`` runs it as it is, scoring each choice as the continuation ``"\\n" + choice`` of the
context (``acc``: highest log-likelihood; ``acc_norm``: highest log-likelihood per character).
"""

from __future__ import annotations

import json
import random
from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError

TASK_NAME = "tokenmill_next_line"
MIN_CONTEXT_LINES = 2
MAX_CONTEXT_LINES = 6
MAX_CONTEXT_CHARS = 600
"""A context is 2 to 6 consecutive non-blank lines of at most 600 characters in all (newlines included)."""
MAX_CHOICE_CHARS = 200
"""Longer lines are neither answers nor distractors (a minified line would dominate acc_norm)."""
NUM_NEAREST_DISTRACTORS = 32
"""Distractors are drawn from the 32 eligible lines closest in length to the answer (similar length, still random)."""
TARGET_DELIMITER = "\n"


@dataclass(frozen=True)
class _Line:
    """A distinct non-blank line and the documents (by position) it occurs in."""

    text: str
    doc_indices: frozenset[int]


@dataclass(frozen=True)
class _Pool:
    """Every distinct line that can be a choice, sorted by (length, text), and their lengths."""

    lines: list[_Line]
    lengths: list[int]


def next_line_items(documents: Iterable[tuple[str, str]], num_items: int, num_choices: int = 4,
                    seed: int = 0) -> list[dict[str, Any]]:
    """At most ``num_items`` items ``{"doc": label, "context": str, "choices": [str], "gold": int}``.

    ``documents``: (doc label, text) pairs, read once. Lines are right-stripped; ``choices[gold]`` is the
    line that follows ``context`` in document ``doc``; the other choices are distinct lines of other
    documents, never equal to it. Items are spread over the documents (one per document before a second
    from any), and the same documents and seed give the same items. Chance accuracy is ``1 / num_choices``.
    Raises ConfigError when ``num_choices < 2`` or ``num_items < 1``, or when no item can be made (fewer than
    two documents, or no document with a two-line context).
    """
    if num_choices < 2 or num_items < 1:
        raise ConfigError(f"next-line task: num_items={num_items}, num_choices={num_choices}; "
                          "need num_items >= 1 and num_choices >= 2 (chance accuracy is 1/num_choices)")
    labels, docs_lines = [], []
    for label, text in documents:
        labels.append(label)
        docs_lines.append([line.rstrip() for line in text.splitlines()])
    rng = random.Random(seed)
    pool = _distractor_pool(docs_lines)
    items: list[dict[str, Any]] = []
    for doc_index, answer_index in _answer_positions(docs_lines, num_items, rng):
        lines = docs_lines[doc_index]
        answer = lines[answer_index]
        distractors = _distractors(pool, answer, doc_index, num_choices - 1, rng)
        if distractors is None:
            continue
        choices = [*distractors, answer]
        rng.shuffle(choices)
        context = _context(lines, answer_index, rng)
        items.append({"doc": labels[doc_index], "context": context, "choices": choices,
                      "gold": choices.index(answer)})
        if len(items) == num_items:
            break
    if not items:
        raise ConfigError(f"next-line task: no item could be made from {len(labels)} validation document(s); it "
                          f"needs two documents or more, one with {MIN_CONTEXT_LINES} consecutive non-blank lines "
                          "followed by a third (add validation documents, or leave the task out)")
    return items


def _is_choice(line: str) -> bool:
    return bool(line.strip()) and len(line) <= MAX_CHOICE_CHARS


def _max_context_lines(lines: list[str], answer_index: int) -> int:
    """How many lines right before ``answer_index`` can form the context (non-blank, within the bounds)."""
    count, num_chars = 0, -1
    while count < MAX_CONTEXT_LINES and answer_index - count - 1 >= 0:
        line = lines[answer_index - count - 1]
        if not line.strip() or num_chars + 1 + len(line) > MAX_CONTEXT_CHARS:
            break
        count, num_chars = count + 1, num_chars + 1 + len(line)
    return count


def _answer_positions(docs_lines: list[list[str]], num_items: int, rng: random.Random) -> list[tuple[int, int]]:
    """(doc index, answer line index) pairs, round-robin over the documents in a shuffled order.

    Twice ``num_items`` positions at most, so that answers without enough distractors can be skipped.
    """
    candidates = []
    for doc_index, lines in enumerate(docs_lines):
        answers = [index for index, line in enumerate(lines)
                   if _is_choice(line) and _max_context_lines(lines, index) >= MIN_CONTEXT_LINES]
        rng.shuffle(answers)
        if answers:
            candidates.append((doc_index, answers))
    rng.shuffle(candidates)
    positions: list[tuple[int, int]] = []
    for round_index in range(max((len(answers) for _, answers in candidates), default=0)):
        positions.extend((doc_index, answers[round_index]) for doc_index, answers in candidates
                         if round_index < len(answers))
        if len(positions) >= 2 * num_items:
            break
    return positions[:2 * num_items]


def _context(lines: list[str], answer_index: int, rng: random.Random) -> str:
    num_lines = rng.randint(MIN_CONTEXT_LINES, _max_context_lines(lines, answer_index))
    return "\n".join(lines[answer_index - num_lines:answer_index])


def _distractor_pool(docs_lines: list[list[str]]) -> _Pool:
    docs_of: dict[str, set[int]] = {}
    for doc_index, lines in enumerate(docs_lines):
        for line in lines:
            if _is_choice(line):
                docs_of.setdefault(line, set()).add(doc_index)
    texts = sorted(docs_of, key=lambda text: (len(text), text))
    return _Pool([_Line(text, frozenset(docs_of[text])) for text in texts], [len(text) for text in texts])


def _distractors(pool: _Pool, answer: str, doc_index: int, count: int, rng: random.Random) -> list[str] | None:
    """``count`` lines of other documents, drawn among those nearest in length to ``answer``; None if too few."""
    lines, lengths = pool.lines, pool.lengths
    above = bisect_left(lengths, len(answer))
    below = above - 1
    eligible: list[str] = []
    while len(eligible) < NUM_NEAREST_DISTRACTORS and (below >= 0 or above < len(lines)):
        take_above = below < 0 or (above < len(lines) and
                                   lengths[above] - len(answer) <= len(answer) - lengths[below])
        line = lines[above] if take_above else lines[below]
        above, below = (above + 1, below) if take_above else (above, below - 1)
        if line.text != answer and line.doc_indices - {doc_index}:
            eligible.append(line.text)
    return rng.sample(eligible, count) if len(eligible) >= count else None


def write_next_line_task(folder: Path, items: list[dict[str, Any]], write_text: Callable[[Path, str], None],
                         data_root: Path | None = None) -> Path:
    """Write ``folder/tokenmill_next_line.jsonl`` (the items), then ``tokenmill_next_line.yaml``; return the YAML.

    The YAML is a plain lm-eval multiple-choice task reading the JSONL (dataset_path json), so it runs offline.
    lm-eval (``datasets``) takes a relative ``data_files`` path from the working directory, never from the
    YAML's folder: with ``data_root`` the path is written relative to it (a run dir names no absolute path, and
    ``cd RUN_DIR && lm_eval --include_path eval/tasks …`` reads it from any copy of the run), without it as an
    absolute path (a folder of its own, run from anywhere). The YAML is written last: a YAML on disk means its
    data is complete. ``write_text(path, text)`` is the caller's atomic writer. Raises ConfigError for an empty
    ``items``.
    """
    if not items:
        raise ConfigError(f"next-line task: no items to write to {folder}; make them with next_line_items first")
    jsonl_path = folder.resolve() / f"{TASK_NAME}.jsonl"
    yaml_path = folder.resolve() / f"{TASK_NAME}.yaml"
    write_text(jsonl_path, "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    data_file = jsonl_path if data_root is None else jsonl_path.relative_to(data_root.resolve())
    write_text(yaml_path, _task_yaml(data_file, num_choices=len(items[0]["choices"])))
    return yaml_path


def _task_yaml(jsonl_path: Path, num_choices: int) -> str:
    """The task's YAML; ``jsonl_path`` as lm-eval will read it (absolute, or relative to the folder it runs in)."""
    config = {
        "task": TASK_NAME,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": jsonl_path.as_posix()}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
        # The context ends at the end of a line; each choice is scored as the continuation "\n" + line.
        "target_delimiter": TARGET_DELIMITER,
        "num_fewshot": 0,
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}
                        for metric in ("acc", "acc_norm")],
        "metadata": {"version": 1.0, "chance_accuracy": 1 / num_choices},
    }
    header = (f"# {TASK_NAME}: which line comes next? Written by tokenmill from the run's validation documents.\n"
              f"# Choices: the true next line and {num_choices - 1} lines of other documents; "
              f"chance accuracy is 1/{num_choices} = {1 / num_choices:.4g}.\n")
    if not jsonl_path.is_absolute():  # lm-eval reads data_files from the working directory, not from here
        header += (f"# data_files is relative to the run dir: run lm_eval there, e.g. cd RUN_DIR && lm_eval "
                   f"--include_path eval/tasks --tasks {TASK_NAME} --model hf --model_args pretrained=$PWD/model\n")
    return header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
