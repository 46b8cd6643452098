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

from core.documents import document_part_files, document_part_fingerprint, iter_documents
from core.errors import ConfigError
from core.files.atomic import read_json
from core.rundir import RunPaths, file_stats, fingerprint
from core.stage import Inputs, Progress, Stage, read_marker, run_stage
from trainer.config import EvalConfig
from trainer.eval import downstream  # its functions called through the module: tests spy on them there
from trainer.eval.next_line_task import TASK_NAME as NEXT_LINE_TASK
from trainer.eval.next_line_task import next_line_items, write_next_line_task

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
    "num_items": {name: count}, "include": [folders]}`` and ``skipped`` (:class:`EvalTasksStage`).

    ``include``: the task folders (default :func:`include_dirs`); they are recorded, so ``tokenmill eval RUN_DIR``
    finds them without the recipe's folder. ``trusted``: the folders whose Python and templates may run (those the
    recipe the user passed names); any other is data only (:mod:`trainer.eval.task_folder_code`).

    Raises ConfigError (one line) for an unknown task, a task YAML with an error, a task whose data are not
    local files or are missing, or code in a folder not trusted.
    """
    if not config.tasks:
        return {"tasks": {}, "num_items": {}, "include": []}
    folders = include_dirs(paths, config, base_dir) if include is None else include
    return run_stage(EvalTasksStage(paths, config, folders, trusted)).as_summary()


class EvalTasksStage(Stage):
    """The recipe's ``eval.tasks`` -> ``eval/tasks/`` (the built-in task) and ``eval/texts/<task>.jsonl``.

    Its inputs are cheap (no lm-eval import, ~2 s): the settings, the val documents' parts, the task folders'
    files and lm-eval's version. The data files the tasks named are found only by checking them with lm-eval:
    the marker lists them, and one changed since is redone (:meth:`changed_since`).
    """

    name = STAGE
    reads = ("ingest", "dedupe")  # the kept validation documents: the built-in task's items

    def __init__(self, paths: RunPaths, config: EvalConfig, include: list[Path],
                 trusted: Collection[Path] = ()) -> None:
        super().__init__(paths)
        self.config, self.include, self.trusted = config, list(include), sorted(Path(path) for path in trusted)
        self.data_files: list[str] = []  # found by run(), recorded in the marker

    @classmethod
    def build(cls, run: Any) -> EvalTasksStage:
        """The folders as the recipe names them, checked now (not later). A recipe that names no task has the
        stage too (it checks nothing): decontamination reads its marker for the tasks to check against."""
        config = run.recipe.eval
        return cls(run.paths, config, include_dirs(run.paths, config, run.base), run.trust.task_folders)

    def inputs(self, unit: str | None) -> Inputs:
        folders = [folder for folder in self.include if folder != self.paths.eval_tasks]  # eval/tasks/: an output
        files = {f"{_recorded(self.paths, folder)}/{name}": identity for folder in folders
                 for name, _, identity in file_stats(folder, folder)}
        parts = {f"ingest/{part.stem}": document_part_fingerprint(self.paths, part)
                 for part in document_part_files(self.paths)}
        settings = {**self.config.model_dump(mode="json"),  # folders as recorded: a copied run dir is the same run
                    "include_folders": [_recorded(self.paths, path) for path in self.include],
                    "trusted": [_recorded(self.paths, path) for path in self.trusted],
                    "lm_eval": importlib.metadata.version("lm_eval")}
        parts["dedupe"] = (read_marker(self.paths, "dedupe") or {}).get("fingerprint", "")
        return Inputs(settings=settings, files=files, upstream=parts)

    def outputs(self, unit: str | None) -> list[Path]:
        recorded = read_marker(self.paths, self.name)
        names = recorded["summary"].get("tasks", {}) if recorded is not None else {}
        return [self.paths.eval_text(name) for name in names]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """The task data files the last check read, when one changed since (a task's own data are its inputs)."""
        data_files = [str(name) for name in recorded.get("data_files", [])]
        if recorded.get("data_files_stats") == _data_files_stats(self.paths, data_files):
            return []
        return [self.paths.root / name for name in data_files]  # an absolute name stays itself

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        paths, config = self.paths, self.config
        if not config.tasks:
            return {"tasks": {}, "num_items": {}, "include": []}
        if NEXT_LINE_TASK in config.tasks:
            write_builtin_task(paths, config)
        task_fps, data_files = downstream.checked_tasks(list(config.tasks), self.include, self.trusted,
                                                        data_root=paths.root)
        self.data_files = [_recorded(paths, paths.root / path) for path in data_files]
        num_items = {}
        for name in sorted(task_fps):
            texts = downstream.task_texts(name, self.include, self.trusted, data_root=paths.root)
            num_items[name] = len(texts)
            paths.write_text(paths.eval_text(name),
                             "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts))
        return {"tasks": task_fps, "num_items": num_items,
                "include": [_recorded(paths, folder) for folder in self.include]}

    def marker_extras(self, unit: str | None, summary: dict[str, Any]) -> dict[str, Any]:
        return {"data_files": self.data_files, "data_files_stats": _data_files_stats(self.paths, self.data_files)}


def _recorded(paths: RunPaths, path: Path) -> str:
    """``path`` as the run dir records it: relative to the run dir when inside it (a copied run dir still
    names its own files), else absolute (a folder or file of the user's, outside the run)."""
    resolved, root = Path(path).resolve(), paths.root.resolve()
    return resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else str(resolved)


def _data_files_stats(paths: RunPaths, data_files: list[str]) -> str:
    """The stats of the task data files (as recorded: relative to the run dir, or absolute), by content."""
    located = [paths.root / name for name in data_files]  # an absolute name stays itself
    return fingerprint(data_files, [file_stats(path.parent, path) for path in located])


def recorded_include(paths: RunPaths) -> list[Path] | None:
    """The task folders the eval-tasks stage last used (a folder inside the run dir recorded relative to it),
    or None before it ran. Read as the data it is (the folders' code runs only if the user's recipe names them)."""
    marker = paths.marker(STAGE)
    summary = read_json(marker).get("summary") if marker.is_file() else None
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
