"""lm-eval task folders read as data: whatever in a task YAML would run code, refused unless the user named the folder.

lm-eval (0.4.13; docs/library-facts.md) runs Python from task folders in 3 ways. A ``!function module.fn`` tag imports
``module.py`` next to the YAML (or any importable module); Python task classes (``class:``), ``process_results``,
custom datasets, metrics, aggregations and filters can only be given that way. Every string it renders
(``doc_to_text``, ``doc_to_target``, ``doc_to_choice``, ``description``, …) that is not a document field is a
Jinja template, rendered in an unsandboxed environment, where ``{{ lipsum.__globals__.os }}`` reaches the
operating system. And ``include:`` pulls in another YAML file that may do either. So a folder the user did not
name (a run dir's ``eval/tasks/``, the folders ``run.yaml`` records) is read as data: every YAML in it, and
every file those include, is composed without constructing anything, and a tag ``yaml.safe_load`` would not
build (``!function``, ``!!python/...``) or Jinja syntax in a string is refused in one line naming the file and
key. The tasks tokenmill writes itself (the next-line task) are plain YAML naming fields, and pass.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path

import yaml

from core.code_trust import HOW_TO_RUN_CODE
from core.errors import ConfigError

SAFE_TAGS = frozenset(tag for tag in yaml.SafeLoader.yaml_constructors if tag is not None)
"""The tags ``yaml.safe_load`` builds (strings, numbers, booleans, null, timestamps, lists, mappings, …)."""
JINJA_MARKERS = ("{{", "{%", "{#")
"""What starts a Jinja expression, statement or comment: a string holding none renders as itself."""
IGNORED_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints"})
"""Folders lm-eval's task index does not read."""


def task_yaml_files(folders: Collection[Path]) -> Iterator[Path]:
    """The files lm-eval's TaskIndex reads: ``**/*.yaml`` outside ``__pycache__`` and notebook checkpoints."""
    for folder in folders:
        for path in sorted(Path(folder).glob("**/*.yaml")):
            if not IGNORED_DIRS & set(path.parts):
                yield path


def refuse_code_in_task_folders(folders: Collection[Path], trusted: Collection[Path]) -> None:
    """ConfigError (one line, naming the file and key) for the first construct that would run code in a YAML
    of a folder not in ``trusted``, or in a file such a YAML includes. ``trusted``: absolute folders."""
    trusted_folders = {Path(folder).resolve() for folder in trusted}
    untrusted = [Path(folder) for folder in folders if Path(folder).resolve() not in trusted_folders]
    seen: set[Path] = set()
    for path in task_yaml_files(untrusted):
        _refuse_code_in_yaml(path, seen)


def _refuse_code_in_yaml(path: Path, seen: set[Path]) -> None:
    """Check one YAML file and, as lm-eval's loader does, the files its top-level ``include`` names."""
    path = path.resolve()
    if path in seen:
        return
    seen.add(path)
    try:
        root = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"task YAML {path} does not load: {' '.join(str(err).split())[:300]}; fix it or move it "
                          "out of the task folder") from None
    if root is None:
        return
    for key, node in _nodes(root, ""):
        problem = _code_in(node)
        if problem is not None:
            raise ConfigError(f"task YAML {path}, key {key or '(top level)'}: {problem}"
                              f", which lm-eval would run as code; this task folder was not named by you, "
                              f"{HOW_TO_RUN_CODE}.")
    for included in _includes(root, path.parent):
        _refuse_code_in_yaml(included, seen)


def _nodes(node: yaml.Node, key: str) -> Iterator[tuple[str, yaml.Node]]:
    """Every node under ``node`` (keys too) with its dotted key path (``metric_list[0].metric``)."""
    yield key, node
    if isinstance(node, yaml.MappingNode):
        for key_node, value in node.value:
            name = f"{key}.{key_node.value}" if key and isinstance(key_node, yaml.ScalarNode) else (
                str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else f"{key}.?")
            yield from _nodes(key_node, name)
            yield from _nodes(value, name)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _nodes(item, f"{key}[{index}]")


def _code_in(node: yaml.Node) -> str | None:
    """What in this one node would run code, or None."""
    if node.tag not in SAFE_TAGS:
        return f"the tag {node.tag} (it imports or builds Python objects)"
    if isinstance(node, yaml.ScalarNode) and isinstance(node.value, str) and any(
            marker in node.value for marker in JINJA_MARKERS):
        return "a Jinja template (lm-eval renders it unsandboxed)"
    return None


def _includes(root: yaml.Node, folder: Path) -> list[Path]:
    """The files a top-level ``include`` names (one or a list), relative to the YAML's folder unless absolute."""
    if not isinstance(root, yaml.MappingNode):
        return []
    for key_node, value in root.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == "include":
            items = value.value if isinstance(value, yaml.SequenceNode) else [value]
            return [folder / str(item.value) for item in items if isinstance(item, yaml.ScalarNode)]
    return []
