"""Downstream evaluation (after export): a Hugging Face model folder + local lm-eval tasks -> per-task scores.

Runs EleutherAI lm-evaluation-harness in-process and offline. A task is accepted only when its config reads
local files (``dataset_path`` a builder such as json with ``dataset_kwargs.data_files`` that all exist, or an
existing local folder or file) and uses only metrics built into lm-eval; anything else is refused
(:mod:`trainer.eval.lm_eval_tasks`) before lm-eval or ``datasets`` could reach for the network. Tasks come only
from the ``eval.include`` folders; ``trusted`` lists those whose Python and templates may run (the folders the
user named: everything else is data only, :mod:`trainer.eval.task_folder_code`). The scores are those the
``lm_eval`` command prints for the same model folder, task and settings (``--model hf --model_args
pretrained=DIR,dtype=float32 --include_path DIR --device cpu --batch_size 8``, and ``--apply_chat_template`` for a
supervised fine-tuning run, whose export carries the chat template it was trained with: each prompt is then
rendered as a user turn followed by the assistant's generation prompt, and few-shot examples as earlier turns,
``fewshot_as_multiturn``, which that flag turns on too).

``datasets`` caches a local data file by path and modification time: a file rewritten in place with its old
mtime restored would be read from the stale cache (the fingerprint, a hash of the content, still changes).

lm-eval (``datasets``) takes a relative ``data_files`` path from the working directory, not from the task
YAML's folder. The run's own built-in task names its data relative to the run dir (a run dir holds no absolute
path), so tokenmill runs lm-eval with the run dir as the working directory (``data_root``), as
``cd RUN_DIR && lm_eval --include_path eval/tasks …`` does. A fingerprint holds no location: a copied run dir
keeps its tasks' fingerprints, and so its cached results.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import inspect
import json
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError, TokenmillError
from core.eval_results import write_result
from core.files.atomic import sha256_file
from core.layout import HF_CONFIG_FILE
from core.rundir import RunPaths
from trainer.config import EvalConfig
from trainer.eval.lm_eval_tasks import load_checked_tasks, task_manager
from trainer.model.hf_files import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, has_chat_template


@dataclass(frozen=True)
class TaskResult:
    """One metric of one lm-eval task (a group gives one result per subtask and metric)."""

    task: str
    metric: str
    """lm-eval's metric name; the filter is kept when it is not "none" (``exact_match,strict-match``)."""
    value: float
    stderr: float | None
    """None where lm-eval reports "N/A"."""
    num_samples: int
    """Documents evaluated (lm-eval's ``n-samples`` "effective": the task's size, or ``limit``)."""


@contextlib.contextmanager
def working_directory(data_root: Path | None) -> Iterator[None]:
    """Run lm-eval in ``data_root`` (None, or a run dir not made yet: where the process runs), where relative
    ``data_files`` are read from.

    The working directory is the process's: lm-eval is called from one thread at a time (the flows call these
    stages one after another, the trainer's processes never call lm-eval).
    """
    if data_root is None or not data_root.is_dir():
        yield
        return
    with contextlib.chdir(data_root):
        yield


def check_tasks(names: list[str], include_dirs: list[Path], trusted: Collection[Path] = (),
                data_root: Path | None = None) -> dict[str, str]:
    """{task name: fingerprint} for every named task (a task, group or tag of the ``eval.include`` folders).

    Each task is built by lm-eval (its local data read), so a task that passes will run. The fingerprint is
    a sha256 over the task's config as lm-eval loaded it, the sha256 of each local data file and the lm-eval
    version: editing the YAML or its data changes it, re-running does not. Raises ConfigError (one line)
    naming what to fix: an include folder that does not exist, a YAML that does not load, an unknown name, a
    task whose data is not local or is missing, a metric lm-eval would download, a task lm-eval cannot build, or
    code in a folder not in ``trusted``.
    """
    return checked_tasks(names, include_dirs, trusted, data_root)[0]


def checked_tasks(names: list[str], include_dirs: list[Path], trusted: Collection[Path] = (),
                  data_root: Path | None = None) -> tuple[dict[str, str], list[Path]]:
    """:func:`check_tasks`, and the local data files the tasks read (for a cheaper check of "unchanged"; a
    relative one is relative to ``data_root``)."""
    fingerprints, all_files = {}, set()
    include_dirs = [folder.resolve() for folder in include_dirs]  # before the working directory changes
    trusted = [folder.resolve() for folder in trusted]
    with working_directory(data_root):
        manager = task_manager(include_dirs, trusted)
        for name in names:
            tasks, data_files = load_checked_tasks(manager, name, trusted)
            configs = {task_name: _located_nowhere(task.dump_config()) for task_name, task in tasks.items()}
            content = {"configs": configs,
                       "data_files": {str(path): sha256_file(path) for path in data_files},
                       "lm_eval": importlib.metadata.version("lm_eval")}
            text = json.dumps(content, sort_keys=True, default=_stable_text)
            fingerprints[name] = hashlib.sha256(text.encode("utf-8")).hexdigest()
            all_files.update(Path(path) for path in data_files)
    return fingerprints, sorted(all_files)


def _located_nowhere(config: dict[str, Any]) -> dict[str, Any]:
    """A task's config without where its YAML lies (lm-eval's ``metadata.config_source``, an absolute path): the
    content decides the fingerprint, so a copied run dir or task folder keeps it."""
    metadata = config.get("metadata")
    if not isinstance(metadata, dict) or "config_source" not in metadata:
        return config
    return {**config, "metadata": {key: value for key, value in metadata.items() if key != "config_source"}}


def task_texts(name: str, include_dirs: list[Path], trusted: Collection[Path] = (),
               data_root: Path | None = None) -> list[str]:
    """The text of every evaluation document of the task, for decontamination.

    One string per (document, choice or target): ``context + target_delimiter + continuation``, the text
    the model scores. Documents are the task's test split (else validation) after ``process_docs``;
    few-shot examples are not included. Raises ConfigError as check_tasks does.
    """
    include_dirs = [folder.resolve() for folder in include_dirs]
    trusted = [folder.resolve() for folder in trusted]
    with working_directory(data_root):
        tasks, _ = load_checked_tasks(task_manager(include_dirs, trusted), name, trusted)
        return [text for task_name in sorted(tasks) for doc in tasks[task_name].eval_docs
                for text in _document_texts(tasks[task_name], doc)]


def run_task(model_dir: Path, name: str, include_dirs: list[Path], *, trusted: Collection[Path] = (),
             batch_size: int = 8, limit: int | None = None, device: str = "cpu", data_root: Path | None = None,
             on_progress: Callable[[int, int], None] | None = None, chat_template: bool = False) -> list[TaskResult]:
    """Evaluate the Hugging Face model folder on one task with lm_eval.simple_evaluate (model "hf", float32).

    Results are sorted by (task, metric). ``limit``: evaluate the first ``limit`` documents only. lm-eval
    seeds Python's, NumPy's and torch's global generators (0, 1234, 1234) as its command line does. Raises
    ConfigError for a model folder without config.json, and as check_tasks does, before loading the model.
    lm-eval draws no progress bar; ``on_progress(requests scored, requests)`` follows it instead
    (:mod:`trainer.eval.lm_eval_progress`). ``chat_template``: render the prompts with the model folder's chat
    template, as ``lm_eval --apply_chat_template`` does (ConfigError when the folder has none).
    """
    if not (model_dir / HF_CONFIG_FILE).is_file():
        raise ConfigError(f"model folder {model_dir} has no config.json; pass a Hugging Face model folder "
                          "(the run's exported model/)")
    if chat_template and not has_chat_template(model_dir):
        raise ConfigError(f"model folder {model_dir} has no chat template ({CHAT_TEMPLATE_FILE} or 'chat_template' "
                          f"in {TOKENIZER_CONFIG_FILE}), and a supervised fine-tuning run is evaluated through it; "
                          "export the model again with the training that writes its template")
    # An absolute path: lm-eval asks the Hub for the model's sha, and huggingface_hub rejects an absolute path
    # as a repo id before any request, where a relative "model" would be looked up online.
    model_args = {"pretrained": str(model_dir.resolve()), "dtype": "float32"}
    include_dirs = [folder.resolve() for folder in include_dirs]
    trusted = [folder.resolve() for folder in trusted]
    with working_directory(data_root):
        manager = task_manager(include_dirs, trusted)
        load_checked_tasks(manager, name, trusted)
        import lm_eval  # lm-eval (~5 s): only when a task runs

        from trainer.eval.lm_eval_progress import CountingHFLM  # imports lm-eval and transformers

        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        # What simple_evaluate(model="hf", model_args=…, batch_size=…, device=…) builds, as lm-eval's command does.
        model = CountingHFLM.create_from_arg_obj(model_args, {"batch_size": batch_size, "device": device})
        model.on_progress = on_progress
        chat = {"apply_chat_template": True, "fewshot_as_multiturn": True} if chat_template else {}
        results = lm_eval.simple_evaluate(model=model, tasks=[name], task_manager=manager, batch_size=batch_size,
                                          limit=limit, device=device, log_samples=False, **chat)
    assert results is not None, "lm-eval returns no results only on ranks other than 0"
    return _task_results(results)


def _task_results(results: dict[str, Any]) -> list[TaskResult]:
    """TaskResults of the leaf tasks (those with ``n-samples``; group aggregates are left out)."""
    found = []
    for task, counts in results["n-samples"].items():
        metrics = results["results"][task]
        for key, value in metrics.items():
            metric, separator, filter_key = key.partition(",")
            # Skips "alias", "name", "sample_len" and the stderr entries, and non-scalar metrics.
            if not separator or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filter_key}", "N/A")
            found.append(TaskResult(task=task, metric=metric if filter_key == "none" else key, value=float(value),
                                    stderr=None if stderr == "N/A" else float(stderr),
                                    num_samples=int(counts["effective"])))
    return sorted(found, key=lambda result: (result.task, result.metric))


def _document_texts(task: Any, doc: dict[str, Any]) -> list[str]:
    """``context + delimiter + continuation`` for each choice (multiple choice) or target of one document."""
    delimiter, context = task.config.target_delimiter, task.doc_to_text(doc)
    choices = task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None
    target = task.doc_to_target(doc)
    if isinstance(context, int) and choices is not None:  # multiple inputs: the choices are the contexts
        return [f"{choice}{delimiter}{target}" for choice in choices]
    if choices is not None:
        return [f"{context}{delimiter}{choice}" for choice in choices]
    targets = target if isinstance(target, list) else [target]
    return [f"{context}{delimiter}{one_target}" for one_target in targets]


def _stable_text(value: Any) -> str:
    """JSON fallback that is the same in every process (``str`` of a function holds its address)."""
    if callable(value):
        try:
            return inspect.getsource(value)
        except (OSError, TypeError):
            return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return str(value)


def run_downstream_task(paths: RunPaths, model: Path, step: int, task: str, checkpoint_fp: str, task_fp: str,
                        include: list[Path], config: EvalConfig, trusted: Collection[Path] = (),
                        on_progress: Callable[[int, int], None] | None = None,
                        chat_template: bool = False) -> dict[str, Any]:
    """Evaluate ``task`` on ``model`` (the export of ``step``) with lm-eval and record the result (or the failure,
    in one line saying what to fix: a task error never loses the results already computed). ``trusted``: the include
    folders whose code may run (:func:`trainer.eval.downstream.run_task`); ``on_progress(requests scored, requests)``
    while lm-eval runs; ``chat_template``: through the model's chat template (a supervised fine-tuning run), which
    the result records."""
    try:
        results = run_task(model, task, include, trusted=trusted, batch_size=config.batch_size,
                           limit=config.limit, data_root=paths.root, on_progress=on_progress,
                           chat_template=chat_template)
    except TokenmillError as err:
        return write_result(paths, step, task, checkpoint_fp, task_fp, error=str(err), chat_template=chat_template)
    except Exception as err:  # lm-eval or the task's own code failed: record it, keep going with the others
        reason = " ".join(str(err).split())[:300]
        return write_result(paths, step, task, checkpoint_fp, task_fp, chat_template=chat_template,
                            error=f"task {task} failed on step {step} ({type(err).__name__}: {reason}); fix the "
                                  "task (see the log) and re-run `tokenmill eval`.")
    rows = [{"task": result.task, "metric": result.metric, "value": result.value, "stderr": result.stderr,
             "num_samples": result.num_samples, "source": None} for result in results]
    return write_result(paths, step, task, checkpoint_fp, task_fp, rows=rows, chat_template=chat_template)
