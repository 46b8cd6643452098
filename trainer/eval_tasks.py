"""Eval-tasks stage (after dedupe, before decontaminate): the recipe's ``eval.tasks`` -> checked tasks and their texts.

Three jobs, so that evaluation never meets a surprise after hours of training:

- the built-in ``tokenmill_next_line`` task (when named) is written from the run's validation documents into
  ``eval/tasks/`` as a plain lm-eval YAML + JSONL (``lm_eval --include_path RUN/eval/tasks`` runs it as-is);
- every named task is loaded through lm-evaluation-harness and checked (it exists, its YAML parses, its data are
  local files): a bad one stops the prepare flow with one line naming it, before anything is trained;
- every task's documents are written to ``eval/texts/<task>.jsonl``, which the decontaminate stage adds to its
  reference, so a train document sharing a long n-gram with a task's item is rejected as ``contaminated``
  with the task named in the detail.

The stage's marker holds the fingerprint of the settings, the val documents and every task's own fingerprint
(its config and data files), so a re-run with nothing changed does nothing.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from core.atomic import read_json
from core.documents import document_part_files, document_part_marker, iter_documents
from core.errors import ConfigError
from core.rundir import RunPaths, file_stats, fingerprint
from trainer.config import EvalConfig
from trainer.next_line_task import TASK_NAME as NEXT_LINE_TASK
from trainer.next_line_task import next_line_items, write_next_line_task

STAGE = "eval-tasks"
MAX_SOURCE_DOCUMENTS = 5000
"""Validation documents read for the built-in task (the first ones in part order): enough for any item count."""


def include_dirs(paths: RunPaths, config: EvalConfig, base_dir: Path) -> list[Path]:
    """``eval.include`` (relative to the recipe's folder), then ``eval/tasks/`` when the built-in task is named.

    Raises ConfigError naming a folder that does not exist.
    """
    folders = []
    for name in config.include:
        folder = (base_dir / name).resolve()
        if not folder.is_dir():
            raise ConfigError(f"eval.include: {name} is not a folder (resolved to {folder}); give folders of local "
                              "lm-eval task YAMLs, relative to the recipe's folder.")
        folders.append(folder)
    if NEXT_LINE_TASK in config.tasks:
        folders.append(paths.eval_tasks)
    return folders


def prepare_eval_tasks(paths: RunPaths, config: EvalConfig, base_dir: Path, include: list[Path] | None = None,
                       trusted: Collection[Path] = ()) -> dict[str, Any]:
    """Write the built-in task, check every task, write each task's texts; ``{"tasks": {name: fingerprint},
    "num_items": {name: count}, "include": [folders]}``.

    ``include``: the task folders (default :func:`include_dirs`); they are recorded, so ``tokenmill eval RUN_DIR``
    finds them without the recipe's folder. ``trusted``: the folders whose Python and templates may run (those the
    recipe the user passed names); any other is data only (:mod:`trainer.task_folder_code`).

    Raises ConfigError (one line) for an unknown task, a task YAML with an error, a task whose data are not
    local files or are missing, or code in a folder not trusted.
    """
    if not config.tasks:
        return {"tasks": {}, "num_items": {}, "include": []}
    folders = include_dirs(paths, config, base_dir) if include is None else include
    settings = _settings(paths, config, folders)
    if (unchanged := _unchanged_summary(paths, settings, folders)) is not None:
        return {**unchanged, "skipped": True}  # the built-in task's files too are as the last check left them
    if NEXT_LINE_TASK in config.tasks:
        write_builtin_task(paths, config)
    from trainer.downstream import checked_tasks, task_texts  # lm-eval imports slowly: only when tasks are named

    task_fps, data_files = checked_tasks(list(config.tasks), folders, trusted, data_root=paths.root)
    record = {"data_files": [_recorded(paths, paths.root / path) for path in data_files]}
    record["inputs"] = _inputs_fingerprint(paths, settings, folders, record["data_files"])
    run_fp = fingerprint(settings, sorted(task_fps.items()))
    done = paths.done_summary(STAGE, run_fp)
    if done is not None and all(paths.eval_text(name).is_file() for name in task_fps):
        paths.mark_done(STAGE, run_fp, done, **record)  # the same summary, now with the inputs' stats
        return {**done, "skipped": True}
    num_items = {}
    for name in sorted(task_fps):
        texts = task_texts(name, folders, trusted, data_root=paths.root)
        num_items[name] = len(texts)
        paths.write_text(paths.eval_text(name),
                         "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts))
    summary = {"tasks": task_fps, "num_items": num_items, "include": [_recorded(paths, folder) for folder in folders]}
    paths.mark_done(STAGE, run_fp, summary, **record)
    return {**summary, "skipped": False}


def unchanged_tasks(paths: RunPaths, config: EvalConfig, folders: list[Path]) -> dict[str, str] | None:
    """``{task: fingerprint}`` as the last check recorded them when nothing it read changed since, else None
    (no lm-eval import: ``tokenmill eval``'s cached check)."""
    unchanged = _unchanged_summary(paths, _settings(paths, config, folders), folders)
    return None if unchanged is None else dict(unchanged.get("tasks", {}))


def _settings(paths: RunPaths, config: EvalConfig, folders: list[Path]) -> str:
    parts = [(part.name, read_json(document_part_marker(paths, part)).get("fingerprint"))
             for part in document_part_files(paths)]
    return fingerprint(STAGE, config.model_dump(), parts, [_recorded(paths, folder) for folder in folders])


def _recorded(paths: RunPaths, path: Path) -> str:
    """``path`` as the run dir records it: relative to the run dir when inside it (a copied run dir still
    names its own files), else absolute (a folder or file of the user's, outside the run)."""
    resolved, root = Path(path).resolve(), paths.root.resolve()
    return resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else str(resolved)


def _inputs_fingerprint(paths: RunPaths, settings: str, folders: list[Path], data_files: list[str]) -> str:
    """The stage's settings and the stats of every file it read (task folders, data files, as recorded) and
    lm-eval's version; files by content and place in the run, so a copied run dir has the same one."""
    located = [paths.root / name for name in data_files]  # an absolute name stays itself
    stats = [file_stats(folder, folder) for folder in folders] + [file_stats(path.parent, path) for path in located]
    return fingerprint(settings, stats, data_files, importlib.metadata.version("lm_eval"))


def _unchanged_summary(paths: RunPaths, settings: str, folders: list[Path]) -> dict[str, Any] | None:
    """The recorded summary when no file the last check read changed (no lm-eval import, ~2 s), else None.

    Checking the tasks again builds each with lm-eval; when the settings, the task folders, the data files
    they named and lm-eval's version are as recorded, it would find the same fingerprints.
    """
    marker = paths.finished_marker(STAGE)
    record = read_json(marker) if marker is not None else {}
    if "inputs" not in record or "summary" not in record:
        return None
    summary = record["summary"]
    if record["inputs"] != _inputs_fingerprint(paths, settings, folders, list(record.get("data_files", []))):
        return None
    return summary if all(paths.eval_text(name).is_file() for name in summary.get("tasks", {})) else None


def recorded_include(paths: RunPaths) -> list[Path] | None:
    """The task folders the eval-tasks stage last used (a folder inside the run dir recorded relative to it),
    or None before it ran."""
    marker = paths.finished_marker(STAGE)
    summary = read_json(marker).get("summary") if marker is not None else None
    return [paths.root / folder for folder in summary["include"]] if summary and "include" in summary else None


def write_builtin_task(paths: RunPaths, config: EvalConfig) -> Path:
    """``eval/tasks/tokenmill_next_line.{yaml,jsonl}`` from the kept validation documents (rewritten each time:
    the items are a pure function of those documents and the settings, so an unchanged run writes the same bytes).

    Raises ConfigError when the validation split has too few documents with several lines.
    """
    documents = []
    for batch in iter_documents(paths, split="val", columns=["doc_id", "text"]):
        documents.extend(zip((str(doc_id) for doc_id in batch.column("doc_id").to_pylist()),
                             batch.column("text").to_pylist(), strict=True))
        if len(documents) >= MAX_SOURCE_DOCUMENTS:
            break
    items = next_line_items(documents[:MAX_SOURCE_DOCUMENTS], config.next_line_items, config.next_line_choices)
    if not items:
        raise ConfigError(f"eval.tasks: {NEXT_LINE_TASK} needs validation documents with several lines, and this "
                          f"run has {len(documents)} validation documents giving none; raise data.val_fraction, or "
                          f"remove {NEXT_LINE_TASK} from eval.tasks.")
    return write_next_line_task(paths.eval_tasks, items, paths.write_text, data_root=paths.root)
