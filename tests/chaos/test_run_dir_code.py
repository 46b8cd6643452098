"""Code from a run dir never runs: task folders, model code and the settings naming them are data (issue #34, 1).

A copied run dir whose ``run.yaml`` says ``eval: {tasks: [evil_task], include: [evil]}``, with a task YAML whose
``doc_to_text: !function utils.doc_to_text`` imports an ``evil/utils.py`` that writes a marker file: opening it
(``tokenmill eval``, the flow's evaluation, the launched evaluator, ``generate``, ``query``, ``report``,
``shards …``) refuses in one line naming the file and key, and the marker is never written. The same folder
named in a recipe the user passes runs. Variants: a Python task class in a group, ``process_results``, a metric
function, a Jinja template, code reached through ``include:``, the folders a stage marker records, ``auto_map``
with ``trust_remote_code: true`` in run.yaml (the evaluator launched from the run dir) and in the export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from core.errors import ConfigError
from core.rundir import RunPaths
from flows.pipeline import evaluation_tasks
from flows.recipe import resolve_recorded_run, resolve_run
from flows.report.stage import write_report
from flows.run_code import refuse_untrusted_code
from tests.chaos.conftest import tokenmill
from tests.chaos.test_bad_inputs import assert_one_line_error
from tests.conftest import build_query_run

WRITE_MARKER = "import os, pathlib\npathlib.Path(os.environ.get('EVIL_MARKER', '{marker}')).write_text('ran')\n"
"""The planted module's first statement: importing it writes the marker file."""


def plant_evil_run(root: Path, task_yaml: str, *, marker: Path, extra: dict[str, str] | None = None) -> Path:
    """A received run dir: run.yaml naming the task folder ``evil`` inside it, the task YAML, a utils.py that
    writes ``marker`` when imported, and one local data file."""
    run = root / "received"
    folder = run / "evil"
    folder.mkdir(parents=True)
    data = folder / "data.jsonl"
    data.write_text(json.dumps({"context": "a", "choices": ["b", "c"], "gold": 0}) + "\n")
    (folder / "utils.py").write_text(WRITE_MARKER.format(marker=marker) + "def doc_to_text(doc):\n    return 'x'\n"
                                     "def process_results(doc, results):\n    return {'acc': 1.0}\n"
                                     "def metric(items):\n    return 1.0\n"
                                     "class EvilTask:\n    pass\n")
    (folder / "evil_task.yaml").write_text(task_yaml.format(data=data))
    for name, text in (extra or {}).items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text.format(data=data, marker=marker))
    (run / "run.yaml").write_text(yaml.safe_dump({
        "name": "evil", "data": {"manifests": ["manifest.yaml"]}, "tokenizer": {"vocab_size": 300},
        "eval": {"tasks": ["evil_task"], "include": ["evil"]}}))
    return run


TASK = ("task: evil_task\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: gold\n")
FUNCTION_TAG = TASK + "doc_to_text: !function utils.doc_to_text\nmetric_list: [{{metric: acc}}]\n"
"""The issue's reproduction."""


def test_eval_of_a_received_run_dir_refuses_its_task_code_in_one_line(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = plant_evil_run(tmp_path, FUNCTION_TAG, marker=marker)
    (run / "checkpoints" / "step-0000001").mkdir(parents=True)  # past "no checkpoint": the tasks are next
    result = tokenmill("eval", run, "--task", "evil_task")
    assert_one_line_error(result, str((run / "evil" / "evil_task.yaml").resolve()), "doc_to_text", "!function",
                          "--recipe")
    assert not marker.exists()


VARIANTS = {
    "class_in_a_group": (TASK.replace("task: evil_task\n", "task: evil_member\n")
                         + "doc_to_text: context\nclass: !function utils.EvilTask\n",
                         {"evil/group.yaml": "group: evil_task\ntask: [evil_member]\n"}, "evil_task.yaml", "class"),
    "process_results": (TASK + "doc_to_text: context\nprocess_results: !function utils.process_results\n", {},
                        "evil_task.yaml", "process_results"),
    "metric_function": (TASK + "doc_to_text: context\nmetric_list: [{{metric: !function utils.metric, "
                               "aggregation: mean}}]\n", {}, "evil_task.yaml", "metric_list[0].metric"),
    "jinja_template": (TASK + "doc_to_text: \"{{{{ lipsum.__globals__['os'].system('touch MARKER') }}}}\"\n"
                              "metric_list: [{{metric: acc}}]\n", {}, "evil_task.yaml", "doc_to_text"),
    "through_include": ("include: ../elsewhere/base.yaml\ntask: evil_task\n",
                        {"elsewhere/base.yaml": FUNCTION_TAG.replace("task: evil_task\n", ""),
                         "elsewhere/utils.py": WRITE_MARKER + "def doc_to_text(doc):\n    return 'x'\n"},
                        "elsewhere/base.yaml", "doc_to_text"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_construct_that_runs_code_is_refused_naming_the_file_and_key(tmp_path: Path, variant: str) -> None:
    task_yaml, extra, refused_file, key = VARIANTS[variant]
    marker = tmp_path / "marker"
    run = plant_evil_run(tmp_path, task_yaml.replace("MARKER", str(marker)), marker=marker, extra=extra)
    refused = (run / refused_file if "/" in refused_file else run / "evil" / refused_file).resolve()
    with pytest.raises(ConfigError) as excinfo:
        evaluation_tasks(resolve_recorded_run(run), "evil_task")
    message = str(excinfo.value)
    assert "\n" not in message and str(refused) in message and key in message, message
    assert not marker.exists()


def test_task_folders_a_stage_marker_records_are_data_too(tmp_path: Path) -> None:
    """``tokenmill eval RUN_DIR`` uses the folders the eval-tasks stage recorded: those are run-dir data."""
    marker = tmp_path / "marker"
    run = plant_evil_run(tmp_path, FUNCTION_TAG, marker=marker)
    outside = Path(shutil.move(run / "evil", tmp_path / "recorded-elsewhere"))
    RunPaths(run).mark_done("eval-tasks", "f" * 64, {"tasks": {}, "num_items": {}, "include": [str(outside)]})
    with pytest.raises(ConfigError, match=r"evil_task\.yaml, key doc_to_text"):
        refuse_untrusted_code(resolve_recorded_run(run))
    with pytest.raises(ConfigError, match=r"evil_task\.yaml, key doc_to_text"):
        evaluation_tasks(resolve_recorded_run(run), "evil_task")
    assert not marker.exists()


def test_the_same_folder_named_in_a_recipe_the_user_passes_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = plant_evil_run(tmp_path, FUNCTION_TAG, marker=marker)
    (tmp_path / "manifest.yaml").write_text(yaml.safe_dump({"name": "m", "sources": [
        {"name": "s", "path": str(tmp_path), "format": "jsonl", "glob": "*.jsonl"}]}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "evil", "data": {"manifests": ["manifest.yaml"]},
                                      "tokenizer": {"vocab_size": 300},
                                      "eval": {"tasks": ["evil_task"], "include": ["received/evil"]}}))
    passed = resolve_run(recipe, run)
    refuse_untrusted_code(passed)
    task_fps, include = evaluation_tasks(passed, "evil_task")
    assert list(task_fps) == ["evil_task"] and include == [(run / "evil").resolve()]
    assert marker.read_text() == "ran"  # named by the user: lm-eval imported utils.py, as asked


def test_the_built_in_task_tokenmill_writes_passes_as_data(tmp_path: Path) -> None:
    from trainer.eval.downstream import check_tasks
    from trainer.eval.next_line_task import TASK_NAME, write_next_line_task

    folder = tmp_path / "received" / "eval" / "tasks"
    folder.mkdir(parents=True)
    items = [{"doc": str(n), "context": f"line {n}\nnext", "choices": ["a", "b"], "gold": n % 2} for n in range(4)]
    write_next_line_task(folder, items, lambda path, text: path.write_text(text))
    assert list(check_tasks([TASK_NAME], [folder])) == [TASK_NAME]  # trusted nothing: it is plain YAML


# ---- model code: auto_map in base_model/ and in the export ------------------------------------------------


def plant_model_code(folder: Path, marker: Path) -> None:
    """A Llama config whose auto_map names configuration_evil.py, which writes ``marker`` when imported."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}))
    (folder / "configuration_evil.py").write_text(
        WRITE_MARKER.format(marker=marker) + "from transformers import LlamaConfig\n\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'llama'\n")
    (folder / "tokenizer.json").write_text("{}")


def test_generate_refuses_auto_map_in_the_export(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = build_query_run(tmp_path / "received")
    plant_model_code(run / "model", marker)
    assert_one_line_error(tokenmill("generate", run, "def "), str(run / "model" / "config.json"), "auto_map")
    assert not marker.exists()


READ_ONLY_COMMANDS = {"query": ("query", "{run}", "SELECT count(*) FROM documents"),
                      "shards verify": ("shards", "verify", "{run}"), "shards stats": ("shards", "stats", "{run}"),
                      "shards sample": ("shards", "sample", "{run}")}


@pytest.mark.parametrize("command", sorted(READ_ONLY_COMMANDS))
def test_read_only_commands_never_touch_the_planted_code(tmp_path: Path, command: str) -> None:
    """query and shards read the run's tables and shards only: nothing planted is imported (the report, which
    reads what query reads, in-process: its command takes ~15 s to start on a busy machine)."""
    marker = tmp_path / "marker"
    run = build_query_run(tmp_path / "received")
    plant_evil_run(tmp_path / "planted", FUNCTION_TAG, marker=marker)
    shutil.copytree(tmp_path / "planted" / "received", run, dirs_exist_ok=True)
    plant_model_code(run / "model", marker)
    plant_model_code(run / "base_model", marker)
    result = tokenmill(*(arg.format(run=run) for arg in READ_ONLY_COMMANDS[command]))
    assert "Traceback" not in result.stdout + result.stderr
    if command == "query":
        write_report(RunPaths(run))
    assert not marker.exists()
