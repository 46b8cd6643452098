"""lm-eval task configs checked for offline use: the tasks a name means, the local files they read, or a refusal.

Tasks come only from the ``eval.include`` folders, through lm-eval's TaskManager: its built-in tasks all read
Hub data (none could run here) and indexing their 14,000 YAML files takes about 20 s. A folder the user did not
name in the recipe they passed (``trusted``) is data only: anything in it that would run code is refused first
(:mod:`trainer.eval.task_folder_code`) and its YAMLs are read with ``resolve_func=False``. A name's task configs
are resolved here as lm-eval's TaskFactory merges them (groups, tags, group-level overrides) before lm-eval
builds anything, because building a task loads its dataset. Every refusal is a one-line ConfigError.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Collection
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError
from trainer.eval.task_folder_code import refuse_code_in_task_folders, task_yaml_files

LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow"})
"""``datasets`` builders that read only the files they are given."""
DATA_FILES_HINT = ("point dataset_kwargs.data_files at local files (e.g. dataset_path: json + "
                   "dataset_kwargs: {data_files: {test: /path/file.jsonl}})")
INCLUDE_HINT = "eval.include adds folders of local lm-eval task YAML files"
MAX_DETAIL_CHARS = 300


@dataclass(frozen=True)
class _Leaf:
    """A task as lm-eval will build it: its name, the YAML it comes from and its config (group overrides applied)."""

    name: str
    yaml_path: Path | None
    config: dict[str, Any]


def task_manager(include_dirs: list[Path], trusted: Collection[Path] = ()) -> Any:
    """lm-eval's TaskManager over the include folders only (no built-in tasks).

    ``trusted``: the folders (absolute) whose Python and templates may run, those the user named; any other
    folder is data only. Raises ConfigError for a folder that does not exist, for a YAML in them that does not
    load (YAML syntax, not a mapping, a missing ``include``: lm-eval's index skips such a file silently, so its
    task would only be reported unknown), and for anything that would run code in a folder not trusted.
    """
    for folder in include_dirs:
        if not folder.is_dir():
            raise ConfigError(f"eval.include folder {folder} does not exist or is not a folder; create it or "
                              "remove it from eval.include")
    refuse_code_in_task_folders(include_dirs, trusted)
    from lm_eval.tasks import TaskManager  # lm-eval (~5 s): only when tasks are named
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval (~5 s): only when tasks are named

    for yaml_path in task_yaml_files(include_dirs):
        try:
            load_yaml(yaml_path, resolve_func=False)
        except (yaml.YAMLError, ValueError, OSError) as err:
            raise ConfigError(f"task YAML {yaml_path} (in eval.include) does not load: {_one_line(err)}; "
                              "fix it or move it out of the folder") from err
    return TaskManager(include_path=[str(folder) for folder in include_dirs] or None, include_defaults=False)


def load_checked_tasks(manager: Any, name: str, trusted: Collection[Path] = ()) -> tuple[dict[str, Any], list[Path]]:
    """({leaf task name: built lm-eval Task}, local data files) of a task, group or tag; refusals first.

    ``manager``: from :func:`task_manager` with the same ``trusted``, which refused code in the other folders.
    """
    resolving = frozenset(Path(folder).resolve() for folder in trusted)
    leaves = _leaves(manager.task_index, name, {}, yaml_path=None, resolving=resolving)
    data_files = sorted({path for leaf in leaves for path in _local_data_files(leaf)})
    for leaf in leaves:
        _check_metrics(leaf)
    entry = manager.task_index[name]
    try:
        loaded = manager.load([name])
    except Exception as err:  # lm-eval raises whatever its config, Jinja or datasets code raises
        raise ConfigError(f"eval task {name!r} ({entry.yaml_path}) cannot be built by lm-eval: {_describe(err)}; "
                          "fix the task YAML or its data") from err
    return loaded["tasks"], data_files


def _load_config(yaml_path: Path, name: str, resolving: frozenset[Path]) -> dict[str, Any]:
    """The YAML as lm-eval's factory reads it (includes merged; ``!function`` imported only in a folder of
    ``resolving``, the trusted ones)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval (~5 s): only when tasks are named

    resolve = any(Path(yaml_path).resolve().is_relative_to(folder) for folder in resolving)
    try:
        return load_yaml(yaml_path, resolve_func=resolve)
    except Exception as err:  # a !function runs the user's module: any exception can come out of it
        raise ConfigError(f"eval task {name!r}: {yaml_path} does not load: {_describe(err)}; fix the YAML or "
                          "the module its !function names") from err


def _leaves(registry: dict[str, Any], name: str, overrides: dict[str, Any], yaml_path: Path | None,
            resolving: frozenset[Path]) -> list[_Leaf]:
    """The tasks lm-eval builds for ``name``, with their configs (as lm_eval.tasks._factory merges them).

    Walked here, before lm-eval builds anything, because building a task downloads its dataset.
    """
    from lm_eval.tasks._index import Kind  # lm-eval (~5 s): only when tasks are named

    entry = registry.get(name)
    if entry is None:
        raise ConfigError(_unknown_task_message(name, registry, yaml_path))
    if entry.kind is Kind.TAG:
        return [leaf for task in sorted(entry.tags)
                for leaf in _leaves(registry, task, overrides, entry.yaml_path, resolving)]
    if entry.kind is Kind.GROUP:
        return _group_leaves(registry, name, _load_config(entry.yaml_path, name, resolving), overrides,
                             entry.yaml_path, resolving)
    return [_Leaf(name=name, yaml_path=entry.yaml_path,
                  config={**_load_config(entry.yaml_path, name, resolving), **overrides, "task": name})]


def _group_leaves(registry: dict[str, Any], group: str, raw: dict[str, Any], overrides: dict[str, Any],
                  yaml_path: Path | None, resolving: frozenset[Path]) -> list[_Leaf]:
    """A group's members: registered names and inline task or group dicts (group-level keys override theirs)."""
    from lm_eval.tasks._factory import GROUP_FIELD_NAMES  # lm-eval (~5 s): only when tasks are named

    merged = {**{key: value for key, value in raw.items() if key not in GROUP_FIELD_NAMES}, **overrides}
    leaves: list[_Leaf] = []
    for item in raw.get("task") or []:
        if isinstance(item, dict) and "group" in item:
            member_overrides = {**merged, **{key: value for key, value in item.items() if key != "group"}}
            leaves += (_leaves(registry, item["group"], member_overrides, yaml_path, resolving)
                       if item["group"] in registry
                       else _group_leaves(registry, f"{group}::{item['group']}", item, merged, yaml_path, resolving))
        elif isinstance(item, dict) and item.get("task") not in registry:
            leaves.append(_Leaf(name=f"{group}::{item.get('task')}", yaml_path=yaml_path,
                                config={**merged, **item}))
        else:
            base, member_overrides = (item, merged) if isinstance(item, str) else (item["task"], {**merged, **item})
            leaves += _leaves(registry, base, member_overrides, yaml_path, resolving)
    return leaves


def _local_data_files(leaf: _Leaf) -> list[Path]:
    """The local files the task reads; ConfigError when its data is not local or is missing."""
    config, where = leaf.config, f"eval task {leaf.name!r} ({leaf.yaml_path})"
    if "class" in config or config.get("custom_dataset") is not None:
        raise ConfigError(f"{where} loads its data with Python code (class or custom_dataset), which tokenmill "
                          f"cannot check is offline; write it as a YAML task and {DATA_FILES_HINT}")
    dataset_path, kwargs = config.get("dataset_path"), config.get("dataset_kwargs") or {}
    data_files, data_dir = kwargs.get("data_files"), kwargs.get("data_dir")
    if dataset_path in LOCAL_BUILDERS and data_files is not None:
        return [path for pattern in _data_file_patterns(data_files) for path in _existing_files(pattern, where)]
    if dataset_path in LOCAL_BUILDERS and data_dir is not None:
        return _existing_files(str(data_dir), where)
    if isinstance(dataset_path, str) and "://" not in dataset_path and Path(dataset_path).exists():
        base = Path(dataset_path)
        patterns = [] if data_files is None else _data_file_patterns(data_files)
        return (_files_under(base) if not patterns else
                [path for pattern in patterns for path in _existing_files(str(base / pattern), where)])
    source = ("no dataset_path" if dataset_path is None else
              f"the Hugging Face Hub dataset {dataset_path!r}" if dataset_path not in LOCAL_BUILDERS else
              f"dataset_path {dataset_path!r} without data_files")
    raise ConfigError(f"{where} reads {source}, but tokenmill evaluates offline: {DATA_FILES_HINT}")


def _data_file_patterns(data_files: Any) -> list[str]:
    """``data_files`` as datasets takes it (a path, a list, or {split: path or list}) flattened to paths."""
    values = list(data_files.values()) if isinstance(data_files, dict) else [data_files]
    return [str(pattern) for value in values for pattern in (value if isinstance(value, list) else [value])]


def _existing_files(pattern: str, where: str) -> list[Path]:
    if "://" in pattern:
        raise ConfigError(f"{where} reads {pattern}, which is not a local file, but tokenmill evaluates offline: "
                          f"{DATA_FILES_HINT}")
    if glob.has_magic(pattern):
        matches = [Path(match) for match in sorted(glob.glob(pattern, recursive=True))]
        if not matches:
            raise ConfigError(f"{where} reads {pattern}, which matches no file; write the data or fix "
                              "dataset_kwargs.data_files")
        return [path for match in matches for path in _files_under(match)]
    if not Path(pattern).exists():
        raise ConfigError(f"{where} reads {pattern}, which does not exist; write the data file or fix "
                          "dataset_kwargs.data_files (an absolute path)")
    return _files_under(Path(pattern))


def _files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(child for child in path.rglob("*") if child.is_file())


def _check_metrics(leaf: _Leaf) -> None:
    """Refuse a metric lm-eval would fetch from the Hugging Face evaluate hub (unknown or ``hf_evaluate``)."""
    from lm_eval.api import metrics as _registers_metrics  # noqa: F401 (importing it fills the registry)
    from lm_eval.api.registry import metric_registry  # lm-eval (~5 s): only when tasks are named

    if leaf.config.get("process_results") is not None:
        return  # lm-eval looks no metric up when the task computes its own
    for metric_config in leaf.config.get("metric_list") or []:
        metric = metric_config.get("metric") if isinstance(metric_config, dict) else None
        if isinstance(metric, str) and (metric_config.get("hf_evaluate") or metric not in metric_registry):
            raise ConfigError(f"eval task {leaf.name!r} ({leaf.yaml_path}) uses metric {metric!r}, which is not "
                              "built into lm-eval (it would be downloaded from the Hugging Face evaluate hub); "
                              "use a built-in metric such as acc, acc_norm or exact_match")


def _unknown_task_message(name: str, registry: dict[str, Any], yaml_path: Path | None) -> str:
    builtin = _builtin_task_yaml(name)
    if builtin is not None:
        from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval (~5 s): only when tasks are named

        dataset = load_yaml(builtin, resolve_func=False).get("dataset_path")
        return (f"eval task {name!r} is a built-in lm-eval task reading the Hugging Face Hub dataset {dataset!r}, "
                f"but tokenmill evaluates offline: copy {builtin} into an eval.include folder and "
                f"{DATA_FILES_HINT}")
    listed_by = f" (listed by {yaml_path})" if yaml_path is not None else ""
    close = get_close_matches(name, list(registry), n=3)
    suggestion = f"did you mean {', '.join(close)}? " if close else ""
    return (f"eval task {name!r}{listed_by} is defined by no YAML in the eval.include folders; {suggestion}"
            f"{INCLUDE_HINT}")


def _builtin_task_yaml(name: str) -> Path | None:
    """The YAML of lm-eval's built-in task or group ``name``, found by text (its index takes ~20 s to build)."""
    import lm_eval.tasks  # lm-eval (~5 s): only when tasks are named

    declaration = re.compile(rf"^(task|group):\s*[\"']?{re.escape(name)}[\"']?\s*$", re.MULTILINE)
    for path in sorted(Path(lm_eval.tasks.__file__).parent.rglob("*.yaml")):
        if declaration.search(path.read_text(encoding="utf-8", errors="replace")):
            return path
    return None


def _describe(err: BaseException) -> str:
    """``Type: message`` of ``err`` and of its first cause (datasets wraps a bad JSON line in a vague error)."""
    cause = err.__cause__ or err.__context__
    described = f"{type(err).__name__}: {_one_line(err)}"
    return described if cause is None else f"{described} (from {type(cause).__name__}: {_one_line(cause)})"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."
