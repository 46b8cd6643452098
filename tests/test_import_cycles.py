"""No import cycles, and an import inside a function only to keep start-up fast (issue 35, item 7).

Every import statement of every module of the project's packages is read with ``ast``, those inside functions and
under ``if TYPE_CHECKING:`` included: a cycle hidden by a function-level import is still a cycle (two modules that
need each other are one module, or share a piece that belongs in a third). A function-level import is allowed only
when it defers a slow import (torch, transformers, lm-eval, Prefect, ...) or an optional extra; its line, or the
line above, says so in a comment.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows", "benchmarks")
INSTALLED = ("core", "pipeline", "tokenization", "trainer", "flows")
"""The packages a ``pip install`` ships: start-up time is theirs (``benchmarks`` are scripts that import what they
measure where they measure it)."""


def module_name(path: Path, root: Path = REPO) -> str:
    """``pipeline/ingest/stage.py`` -> ``pipeline.ingest.stage``; ``pipeline/__init__.py`` -> ``pipeline``."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(packages: tuple[str, ...] = PACKAGES, root: Path = REPO) -> dict[str, Path]:
    """Module name -> file, for every module of ``packages`` under ``root``."""
    return {module_name(path, root): path for package in packages for path in sorted((root / package).rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path], root: Path = REPO) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, by any import statement at any depth.

    ``from pkg import name`` imports the module ``pkg.name`` when that is a module, else ``pkg`` itself; a relative
    import is resolved against ``path``'s package.
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    return found - {name}


def import_graph(modules: dict[str, Path], root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules it imports."""
    return {name: imported_modules(path, modules, root) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through each module that is on one, as a chain ``[a, b, ..., a]`` (each cycle once).

    Empty exactly when the graph has no cycle: every module on a cycle finds one back to itself.
    """
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        chain = shortest_path_back(graph, start)
        if chain:
            low = chain.index(min(chain))
            found.add(tuple(chain[low:] + chain[:low]))
    return [[*chain, chain[0]] for chain in sorted(found)]


def shortest_path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The modules on a shortest chain of imports from ``start`` back to it (``start`` first), or None."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(previous[chain[-1]])
                    return chain[::-1]
                if target not in previous:
                    previous[target] = node
                    next_frontier.append(target)
        frontier = next_frontier
    return None


def function_level_imports(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements inside a function or class, not at the module's top level (nor in a top-level if/try)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level = {id(node) for node in tree.body}
    top_level |= {id(child) for node in tree.body if isinstance(node, ast.If | ast.Try)
                  for child in ast.walk(node) if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top_level:
            yield node


def imports_without_a_reason(path: Path) -> list[int]:
    """Line numbers of the function-level imports of ``path`` with no comment on their lines or the line above."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    commented = {token.start[0] for token in tokens if token.type == tokenize.COMMENT}
    return sorted(node.lineno for node in function_level_imports(path)
                  if not set(range(node.lineno - 1, (node.end_lineno or node.lineno) + 1)) & commented)


def test_the_project_has_no_import_cycle() -> None:
    found = cycles(import_graph(project_modules()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in found)


def test_every_function_level_import_says_why() -> None:
    bare = [f"{path.relative_to(REPO)}:{line}" for path in project_modules(INSTALLED).values()
            for line in imports_without_a_reason(path)]
    assert not bare, f"{len(bare)} function-level imports without a comment saying why:\n" + "\n".join(bare)


def test_the_checks_see_what_a_function_hides(tmp_path: Path) -> None:
    """A cycle closed by an import inside a function, and an unexplained function-level import, are both found."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("from . import c\n")
    (package / "c.py").write_text("import os\n\n\ndef f():\n    import pkg.a\n\n\ndef g():\n"
                                  "    import json  # a reason\n")
    (package / "d.py").write_text("from pkg.a import thing\n")
    graph = import_graph(project_modules(("pkg",), tmp_path), tmp_path)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert imports_without_a_reason(package / "c.py") == [5]
