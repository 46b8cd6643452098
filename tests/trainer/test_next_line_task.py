"""trainer/eval/next_line_task.py on real standard-library files: true next lines, foreign distractors, lm-eval reads
it."""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import yaml

from core.errors import ConfigError
from core.files.atomic import write_text_atomic
from trainer.eval.next_line_task import (
    MAX_CONTEXT_CHARS,
    MAX_CONTEXT_LINES,
    MIN_CONTEXT_LINES,
    TASK_NAME,
    next_line_items,
    write_next_line_task,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def documents() -> list[tuple[str, str]]:
    return [(path.name, path.read_text(encoding="utf-8")) for path in sorted(STDLIB.glob("*.py"))[:40]]


def lines_of(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


def follows_in(context: str, answer: str, lines: list[str]) -> bool:
    """``context`` is consecutive lines of ``lines`` and ``answer`` is the line after them."""
    window = [*context.split("\n"), answer]
    return any(lines[start:start + len(window)] == window for start in range(len(lines) - len(window) + 1))


def test_the_gold_choice_is_the_true_next_line(documents: list[tuple[str, str]]) -> None:
    texts = dict(documents)
    items = next_line_items(documents, 60)
    assert len(items) == 60
    for item in items:
        assert follows_in(item["context"], item["choices"][item["gold"]], lines_of(texts[item["doc"]]))
        context_lines = item["context"].split("\n")
        assert MIN_CONTEXT_LINES <= len(context_lines) <= MAX_CONTEXT_LINES
        assert len(item["context"]) <= MAX_CONTEXT_CHARS and all(line.strip() for line in context_lines)


def test_distractors_are_lines_of_other_documents(documents: list[tuple[str, str]]) -> None:
    line_sets = {label: set(lines_of(text)) for label, text in documents}
    for item in next_line_items(documents, 60, num_choices=5):
        answer = item["choices"][item["gold"]]
        distractors = [choice for index, choice in enumerate(item["choices"]) if index != item["gold"]]
        assert len(distractors) == 4 and len(set(item["choices"])) == 5
        for distractor in distractors:
            assert distractor.strip() and distractor != answer
            assert any(distractor in lines for label, lines in line_sets.items() if label != item["doc"])


def test_items_are_deterministic_spread_and_shuffled(documents: list[tuple[str, str]]) -> None:
    items = next_line_items(documents, 30, seed=3)
    assert next_line_items(iter(documents), 30, seed=3) == items
    assert next_line_items(documents, 30, seed=4) != items
    assert len({item["doc"] for item in items}) == 30  # one item per document before a second from any
    assert len(Counter(item["gold"] for item in items)) == 4  # the answer is not always in one position


def test_a_single_document_gives_no_item(documents: list[tuple[str, str]]) -> None:
    with pytest.raises(ConfigError, match="needs two documents"):
        next_line_items(documents[:1], 10)
    with pytest.raises(ConfigError, match="num_choices >= 2"):
        next_line_items(documents, 10, num_choices=1)


def test_the_written_task_round_trips_and_states_chance(documents: list[tuple[str, str]], tmp_path: Path) -> None:
    items = next_line_items(documents, 12, num_choices=4)
    yaml_path = write_next_line_task(tmp_path / "tasks", items, write_text_atomic)
    assert yaml_path == (tmp_path / "tasks" / f"{TASK_NAME}.yaml").resolve()
    text = yaml_path.read_text(encoding="utf-8")
    config = yaml.safe_load(text)
    data_file = Path(config["dataset_kwargs"]["data_files"]["test"])
    assert data_file.is_absolute() and data_file.parent == yaml_path.parent
    assert [json.loads(line) for line in data_file.read_text(encoding="utf-8").splitlines()] == items
    assert (config["task"], config["output_type"], config["target_delimiter"]) == (TASK_NAME, "multiple_choice", "\n")
    assert [metric["metric"] for metric in config["metric_list"]] == ["acc", "acc_norm"]
    assert "chance accuracy is 1/4" in text and config["metadata"]["chance_accuracy"] == 0.25


def test_lm_eval_scores_each_choice_as_the_next_line(documents: list[tuple[str, str]], tmp_path: Path) -> None:
    """lm-eval itself reads the written folder and asks for log P("\\n" + choice | context)."""
    from lm_eval.tasks import TaskManager

    items = next_line_items(documents, 5)
    write_next_line_task(tmp_path, items, write_text_atomic)
    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load([TASK_NAME])["tasks"][TASK_NAME]
    task.build_all_requests(limit=None, rank=0, world_size=1)
    requests = sorted(task.instances, key=lambda instance: (instance.doc_id, instance.idx))
    assert [request.args for request in requests] == [(item["context"], "\n" + choice)
                                                      for item in items for choice in item["choices"]]
    assert [task.doc_to_target(doc) for doc in task.eval_docs] == [item["gold"] for item in items]
