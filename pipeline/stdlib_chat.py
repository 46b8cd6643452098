"""A built-in chat corpus from local real text: the standard library's docstrings -> question/answer records.

Every Python has its standard library's documentation in its docstrings, so this corpus needs no download: each
public function, class and method of a fixed list of modules whose docstring opens with a real sentence becomes a
question (``What does `json.dumps` do?``) and its answer (the docstring's first paragraph, re-flowed). Most records
are in the ``messages`` format, some with a system turn and some with two question/answer rounds; every tenth is a
``prompt``/``completion`` record, so both formats of :mod:`tokenization.chat.records` are exercised.

The records are committed as ``data_manifests/python-stdlib-chat.jsonl`` (the worked example's corpus,
``data_manifests/python-stdlib-chat.yaml``), not made at ingest time: the example then trains on the same
conversations on every machine, whatever its Python. This module rebuilds that file::

    python -m pipeline.stdlib_chat data_manifests/python-stdlib-chat.jsonl

The output is a pure function of the Python version's library sources (read with ``ast``, in source order, nothing
imported or run): :data:`BUILT_WITH` is the version the committed file was made with. Each docstring is the
definition's own, never inherited from a base class (``inspect.getdoc`` would give an override its parent's text).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILT_WITH = (3, 11)
"""The Python (major, minor) whose docstrings the committed corpus holds."""
MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "colorsys",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "email.message",
    "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "heapq", "hmac", "html", "http.client", "http.cookies", "http.server", "inspect", "io", "ipaddress",
    "json", "linecache", "logging", "mailbox", "numbers", "operator", "optparse", "pathlib", "plistlib", "pprint",
    "pydoc", "queue", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "smtplib", "socketserver",
    "stat", "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tomllib",
    "traceback", "types", "typing", "unittest.case", "unittest.mock", "urllib.parse", "urllib.request", "uuid",
    "warnings", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zoneinfo",
)
"""The modules asked about, in this order: pure-Python ones (their docstrings are in their source) whose
documentation is the same on every platform (no ``os.path``, which is posixpath or ntpath, no ``subprocess``,
``socket`` or ``asyncio``)."""
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 40, 600
"""An answer shorter than this says too little ("Return x."); a longer one is a manual page, not an answer."""
SYSTEM_PROMPT = "You answer questions about the Python standard library in a few sentences."
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)")
"""A docstring that opens with its own signature (``sqrt(x) -> float``), the older C style: not a sentence."""


@dataclass(frozen=True)
class Entry:
    """One documented name and what the corpus says about it."""

    module: str
    name: str
    """The qualified name, ``json.dumps`` or ``pathlib.Path.read_text``."""
    kind: str
    """``function``, ``class`` or ``method``: the question's wording."""
    answer: str


def stdlib_entries(modules: tuple[str, ...] = MODULES) -> list[Entry]:
    """Every documented public function, class and method of ``modules``, in order; each answer text once."""
    entries, seen = [], set()
    for module_name in modules:
        for entry in source_entries(module_name, module_source(module_name)):
            if entry.answer not in seen:
                seen.add(entry.answer)
                entries.append(entry)
    return entries


def module_source(module_name: str) -> str:
    """The source text of a standard-library module, read from the interpreter's library folder, never imported:
    importing runs code, and whatever was imported before may have replaced a function by a wrapper (torch replaces
    ``inspect.getfile``); some modules (``abc``, ``io``) are frozen into the interpreter, with no file behind them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative = Path(*module_name.split("."))
    for path in (stdlib / relative.with_suffix(".py"), stdlib / relative / "__init__.py"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise ValueError(f"{module_name}: no Python source in {stdlib} (a C module?); remove it from MODULES")


def source_entries(module_name: str, source: str) -> Iterator[Entry]:
    """The module's top-level public functions and classes (those in ``__all__`` when it lists them) and the
    public methods of those classes, in source order, each with its own docstring (never a base class's)."""
    tree = ast.parse(source)
    public = _declared_names(tree)
    for node in tree.body:
        if not isinstance(node, DEFINITIONS) or not _is_public(node.name, public):
            continue
        name = f"{module_name}.{node.name}"
        if isinstance(node, ast.ClassDef):
            yield from _entry(module_name, name, "class", node)
            for method in node.body:
                if isinstance(method, DEFINITIONS[:2]) and not method.name.startswith("_"):
                    yield from _entry(module_name, f"{name}.{method.name}", "method", method)
        else:
            yield from _entry(module_name, name, "function", node)


def _declared_names(tree: ast.Module) -> set[str] | None:
    """The names of a literal top-level ``__all__``; None when the module has none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == "__all__"
                                                for target in node.targets):
            try:
                return {str(name) for name in ast.literal_eval(node.value)}
            except ValueError:
                return None
    return None


def _is_public(name: str, declared: set[str] | None) -> bool:
    return name in declared if declared is not None else not name.startswith("_")


def _entry(module: str, name: str, kind: str, node: ast.AST) -> Iterator[Entry]:
    """The entry of ``node`` when its own docstring opens with a usable paragraph."""
    doc = ast.get_docstring(node, clean=True)
    answer = first_paragraph(doc) if doc else None
    if answer is not None:
        yield Entry(module, name, kind, answer)


def first_paragraph(docstring: str) -> str | None:
    """The docstring's first paragraph on one line; None when it is a signature, too short or too long."""
    paragraph = inspect.cleandoc(docstring).split("\n\n", 1)[0]
    answer = " ".join(paragraph.split())
    if SIGNATURE_LINE.match(answer) or not MIN_ANSWER_CHARS <= len(answer) <= MAX_ANSWER_CHARS:
        return None
    return answer


def question(entry: Entry) -> str:
    if entry.kind == "class":
        return f"What is `{entry.name}`?"
    if entry.kind == "method":
        return f"What does the `{entry.name}` method do?"
    return f"What does `{entry.name}` do?"


def chat_records(entries: list[Entry]) -> list[dict[str, Any]]:
    """The records, in order: every 10th a prompt/completion, every 4th two rounds (its entry and the next of the
    same module), every 7th with a system turn; the rest one question and its answer. ``id``: the first name."""
    records, index = [], 0
    while index < len(entries):
        entry, number = entries[index], len(records)
        follow_up = entries[index + 1] if index + 1 < len(entries) else None
        if number % 10 == 9:
            records.append({"id": entry.name, "prompt": question(entry), "completion": entry.answer})
            index += 1
            continue
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if number % 7 == 6 else []
        messages += [{"role": "user", "content": question(entry)}, {"role": "assistant", "content": entry.answer}]
        index += 1
        if number % 4 == 3 and follow_up is not None and follow_up.module == entry.module:
            messages += [{"role": "user", "content": f"And `{follow_up.name}`?"},
                         {"role": "assistant", "content": follow_up.answer}]
            index += 1
        records.append({"id": entry.name, "messages": messages})
    return records


def corpus_text() -> str:
    """The corpus as JSON lines (UTF-8, one record a line, keys in a fixed order): what the committed file holds."""
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in chat_records(stdlib_entries()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.stdlib_chat", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the JSON-lines file to write (data_manifests/python-stdlib-chat.jsonl)")
    args = parser.parse_args(argv)
    if sys.version_info[:2] != BUILT_WITH:
        print(f"note: Python {sys.version_info[0]}.{sys.version_info[1]} writes other docstrings than the "
              f"committed corpus's {BUILT_WITH[0]}.{BUILT_WITH[1]}", file=sys.stderr)
    args.out.write_text(corpus_text(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
