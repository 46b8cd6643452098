"""Only ``core/layout.py`` spells a run's file and folder names, and only ``core/`` writes them by hand: every other
module asks :class:`core.layout.RunLayout` (through :class:`core.rundir.RunPaths`) for a path, or
``run_key(RELATIVE.…)`` for a bucket key, and writes through RunPaths (``paths.write_json``, ``paths.atomic_write``,
``paths.mark_done``, ``paths.lock()``, …).

The names are the ones ``core/layout.py`` spells (read with ``ast``, so a name added there is checked everywhere):
whole names (``state.json``, ``shards``) and the prefixes of numbered ones (``step-`` in ``f"step-{n:07d}"``,
``part-`` in ``"part-*.parquet"``). A string anywhere else (any segment of it, f-string pieces included) that
spells a file name, or a folder name in a path (``"a/b"``, ``x / "name"``, ``Path("name")``, ``.glob("name")``),
fails; so does extending a layout path by hand (``paths.report / …``). Docstrings and messages (text with spaces)
may mention ``checkpoints/``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
LAYOUT_OWNER = REPO / "core" / "layout.py"
PATH_CALLS = {"Path", "PurePath", "PurePosixPath", "joinpath", "glob", "rglob", "with_name"}
NAME_LIKE = re.compile(r"^\.?[A-Za-z_][\w.\-=]*$")
HOLE = "\0"
"""Stands for an f-string's formatted value or a glob's ``*`` in a string's text."""


def _skipped(tree: ast.AST) -> set[int]:
    """ids of the docstrings and of the f-strings' pieces (an f-string is read whole)."""
    docstrings = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return docstrings | {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}


def _text(node: ast.AST) -> str | None:
    """A string constant's or an f-string's text, each formatted value as HOLE; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else HOLE for part in node.values)
    return None


def _segments(text: str) -> list[tuple[str, str]]:
    """``(kind, segment)`` of every ``/``-separated piece of ``text`` that could be a name: ``name`` (whole),
    ``prefix`` (a name's start, a hole after it); suffixes are skipped, and so is text with spaces (a message)."""
    found: list[tuple[str, str]] = []
    if any(char.isspace() for char in text):
        return found
    for segment in text.replace("*", HOLE).split("/"):
        segment = segment.lstrip("^(")  # a regex's anchor or group
        if not segment or segment.startswith(HOLE):
            continue
        head = segment.split(HOLE, 1)[0]
        kind = "prefix" if HOLE in segment else "name"
        if NAME_LIKE.match(head.split("\\", 1)[0]):
            found.append((kind, head.split("\\", 1)[0] if kind == "name" else head))
    return found


def _not_names(tree: ast.AST) -> set[int]:
    """ids of the strings in core/layout.py that are no run-dir name: regexes, ``__setattr__``'s field name."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    return {id(node.args[0]) for node in calls if node.func.attr == "compile" and node.args} \
        | {id(node.args[1]) for node in calls if node.func.attr == "__setattr__" and len(node.args) > 1}


@dataclass
class Layout:
    """What ``core/layout.py`` spells: whole names, numbered names' prefixes, RunLayout's path members, and the
    functions that make a name (``part_file_name``)."""

    names: set[str] = field(default_factory=set)
    prefixes: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)
    namers: set[str] = field(default_factory=set)


def read_layout(source: str) -> Layout:
    """The names and members ``source`` (core/layout.py) spells and defines."""
    tree = ast.parse(source)
    layout, skipped = Layout(), _skipped(tree) | _not_names(tree)
    layout.namers = {node.name for node in getattr(tree, "body", []) if isinstance(node, ast.FunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "RunLayout":
            layout.members |= {item.name for item in node.body if isinstance(item, ast.FunctionDef)
                               and not item.name.startswith("_") and item.name != "key"}
        text = _text(node) if id(node) not in skipped else None
        for kind, segment in _segments(text or ""):
            (layout.prefixes if kind == "prefix" else layout.names).add(segment)
    return layout


LAYOUT = read_layout(LAYOUT_OWNER.read_text(encoding="utf-8"))


def _call_name(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def _path_contexts(tree: ast.AST) -> set[int]:
    """ids of the nodes used as a path piece: ``x / node``, ``Path(node)``, ``p.glob(node)``, and the value of
    a module constant used so (``x / NAME`` with ``NAME = "…"``)."""
    constants = {target.id: node.value for node in getattr(tree, "body", []) if isinstance(node, ast.Assign)
                 for target in node.targets if isinstance(target, ast.Name)}
    pieces: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            pieces.append(node.right)
        elif isinstance(node, ast.Call) and _call_name(node) in PATH_CALLS:
            pieces.extend(node.args)
    pieces += [constants[piece.id] for piece in pieces if isinstance(piece, ast.Name) and piece.id in constants]
    return {id(piece) for piece in pieces}


def _spelled_name(text: str, in_path: bool) -> str | None:
    """The first run-dir name ``text`` spells: a file name (``x.y``) anywhere, a folder name in a path."""
    path_shaped = in_path or "/" in text
    for kind, segment in _segments(text):
        if any(segment.startswith(prefix) for prefix in LAYOUT.prefixes):
            return segment
        if kind == "name" and segment in LAYOUT.names and (path_shaped or "." in segment):
            return segment
    return None


def _is_a_name(node: ast.AST) -> bool:
    """A string, a constant (``DUPLICATES_FILE``, ``hf_model.CONFIG_NAME``) or a layout naming call
    (``part_file_name(3)``): what a join onto a layout path must not add (a variable may be anything)."""
    if isinstance(node, ast.Call):
        return _call_name(node) in LAYOUT.namers
    identifier = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return _text(node) is not None or (identifier.isupper() and len(identifier) > 1)


def _extends_layout_path(node: ast.AST, owner: bool) -> bool:
    """``paths.report / "x"``, ``paths.dedupe / STATE_FILE`` (or ``paths.eval_model(3) / …``; in RunPaths itself
    ``self.report / …``): a name added to a layout path by hand."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)) or not _is_a_name(node.right):
        return False
    left = node.left.func if isinstance(node.left, ast.Call) else node.left
    if not isinstance(left, ast.Attribute) or left.attr not in LAYOUT.members:
        return False
    base = ast.unparse(left.value)
    return base.endswith("paths") or (owner and base == "self")


def hand_spelled_names(source: str, *, owner: bool = False) -> list[tuple[int, str]]:
    """(line, code) of every run-dir name spelled, or layout path extended, outside ``core/layout.py``.

    ``owner``: the source is RunPaths's module (``self`` is a layout there).
    """
    tree = ast.parse(source)
    skipped, in_path = _skipped(tree), _path_contexts(tree)
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        text = _text(node) if id(node) not in skipped else None
        spelled = text is not None and _spelled_name(text, id(node) in in_path) is not None
        if spelled or _extends_layout_path(node, owner):
            found.append(node)
        elif isinstance(node, ast.Call) and _call_name(node) == "RunPaths" and node.args \
                and isinstance(node.args[0], ast.Call) and _call_name(node.args[0]) == "Path":
            found.append(node)  # RunPaths takes a str or a Path as it is; resolve it once, pass it down
    return sorted({(node.lineno, ast.unparse(node)) for node in found})


def test_the_layout_is_read_from_core_layout() -> None:
    assert {"run.yaml", ".lock", "shards", "index.parquet", "state.json", "duplicates.parquet", "latest",
            "train.jsonl", "index.html", "mlflow.db", "sealed"} <= LAYOUT.names
    assert {"step-", "part-", "split=", "source=", "segment-"} <= LAYOUT.prefixes
    assert {"docs", "report", "shard_index", "eval_model", "stage_marker"} <= LAYOUT.members


def test_the_check_finds_each_kind_of_hand_spelled_name() -> None:
    code = ('a = run_dir / "shards" / "index.parquet"\nb = Path("metrics") / "tensorboard"\n'
            'c = RunPaths(Path(run_dir))\nd = root / f"checkpoints/step-{n}"\ne = root.joinpath("stages")\n'
            'f = folder / "state.json"\ng = f"{url}/metrics/train.jsonl"\nSTATE = "decontaminate.json"\n'
            'i = f"stages/ingest/{part}.json"\nj = paths.docs.glob("part-*.parquet")\nk = paths.dedupe / STATE\n'
            'l = re.compile(r"docs/(part-[0-9]{5,})\\.parquet")\nm = f"{base}/{LOCK}"\n'
            '"""run_dir / "shards" in a docstring"""\nraise E(f"{p}: no marker (stages/ingest/{u}.json); re-run")\n'
            'n = {"dedupe": 1, "model": 2}\no = paths.shard_index\np = run_key(RELATIVE.duplicates)\n'
            'q = paths.docs / name\n')
    assert sorted({line for line, _ in hand_spelled_names(code)}) == list(range(1, 13))


def test_in_run_paths_self_is_a_layout() -> None:
    code = 'def marker(self):\n    return self.stages / "x.json"\n'
    assert hand_spelled_names(code) == []
    assert [line for line, _ in hand_spelled_names(code, owner=True)] == [2]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_spells_a_run_dir_name(package: str) -> None:
    offenders = [f"{path.relative_to(REPO)}:{line}: {code}"
                 for path in sorted((REPO / package).rglob("*.py")) if path != LAYOUT_OWNER
                 for line, code in hand_spelled_names(path.read_text(encoding="utf-8"),
                                                      owner=path.name == "rundir.py")]
    assert not offenders, ("ask core.layout.RunLayout for these (paths.<name>, or run_key(RELATIVE.<name>) for a "
                           "relative key; add a property there):\n" + "\n".join(offenders))


WRITE_HELPERS = {"atomic_path", "write_bytes_atomic", "write_text_atomic", "write_json_atomic", "remove_stale_temps",
                 "RunLock"}
"""core.files.atomic's writers and core.runlock's lock: RunPaths's methods call them; nothing outside core/ does."""
HELPER_MODULES = {"atomic", "core.files.atomic", "runlock", "core.runlock"}


def _calls_a_write_helper(node: ast.AST) -> bool:
    """``write_json_atomic(…)`` or ``atomic.write_json_atomic(…)``; ``paths.remove_stale_temps(…)`` is RunPaths's."""
    if not isinstance(node, ast.Call) or _call_name(node) not in WRITE_HELPERS:
        return False
    return isinstance(node.func, ast.Name) or ast.unparse(node.func.value) in HELPER_MODULES


def direct_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every call of an atomic-write helper or of RunLock in ``source``."""
    return sorted((node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
                  if _calls_a_write_helper(node))


def test_the_write_check_finds_each_helper_call() -> None:
    code = ('write_json_atomic(paths.stages / "x.json", {})\nwith atomic_path(target) as tmp:\n    pass\n'
            'atomic.write_text_atomic(p, "t")\nRunLock(root)\npaths.write_json(p, {})\npaths.lock()\n'
            'paths.remove_stale_temps(folder)\nremove_stale_temps(folder)\n')
    assert [line for line, _ in direct_writes(code)] == [1, 2, 4, 5, 9]


WRITES_OUTSIDE_A_RUN_DIR = {("pipeline/filters/quality_classifier.py", "atomic_path(out)")}
"""(module, call) of the atomic writes of files that are no run dir's: ``tokenmill classifier train --out``'s model."""


@pytest.mark.parametrize("package", [package for package in PACKAGES if package != "core"])
def test_no_module_outside_core_writes_run_dir_files_by_hand(package: str) -> None:
    offenders = [f"{module}:{line}: {code}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for module in [path.relative_to(REPO).as_posix()]
                 for line, code in direct_writes(path.read_text(encoding="utf-8"))
                 if (module, code) not in WRITES_OUTSIDE_A_RUN_DIR]
    assert not offenders, "write through core.rundir.RunPaths (paths.write_json, paths.atomic_write, " \
                          "paths.mark_done, paths.lock(), …):\n" + "\n".join(offenders)
