"""No import cycles, and an import inside a function only to keep start-up fast (issue 35, item 7).

Every import statement of every module of the project's packages is read with ``ast``, those inside functions
included: a cycle hidden by a function-level import is still a cycle (two modules that need each other are one
module, or share a piece that belongs in a third). A function-level import is allowed only when it defers a slow
import (torch, transformers, lm_eval, ...); its line, or the line above, says so in a comment.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows", "benchmarks")


def module_name(path: Path) -> str:
    """``pipeline/ingest.py`` -> ``pipeline.ingest``; ``pipeline/__init__.py`` -> ``pipeline``."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the project's packages."""
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def imported_names(path: Path, modules: dict[str, Path]) -> Iterator[tuple[ast.stmt, str]]:
    """(statement, project module it imports) for every import statement in ``path``, at any depth.

    ``from pkg import name`` imports the module ``pkg.name`` when that is a module, else ``pkg`` itself; a relative
    import is resolved against ``path``'s package.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    yield node, f"{base}.{alias.name}"
                elif base in modules:
                    yield node, base


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (itself excluded)."""
    return {name: {target for _, target in imported_names(path, modules) if target != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that is on a cycle, as a chain ``[a, b, ..., a]``, deduplicated."""
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        chain = shortest_path_back(graph, start)
        if chain:
            low = chain.index(min(chain))
            found.add(tuple(chain[low:] + chain[:low]))
    return [[*chain, chain[0]] for chain in sorted(found)]


def shortest_path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest chain of modules from ``start`` back to ``start`` (without repeating it), or None."""
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


def function_level_imports(path: Path) -> Iterator[ast.stmt]:
    """Import statements inside a function (or a class body), not at the module's top level."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level = {id(node) for node in tree.body}
    top_level |= {id(child) for node in tree.body if isinstance(node, ast.If | ast.Try)
                  for child in ast.walk(node) if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top_level:
            yield node


def commented_lines(path: Path) -> set[int]:
    """Line numbers that carry a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return {token.start[0] for token in tokens if token.type == tokenize.COMMENT}


def test_the_project_has_no_import_cycle() -> None:
    found = cycles(import_graph(project_modules()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(chain) for chain in found)


def test_every_function_level_import_says_why() -> None:
    bare = []
    for path in project_modules().values():
        comments = commented_lines(path)
        bare += [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}" for node in function_level_imports(path)
                 if not {node.lineno, node.lineno - 1, getattr(node, "end_lineno", node.lineno)} & comments]
    assert not bare, f"{len(bare)} function-level imports without a comment saying why:\n" + "\n".join(bare)


def test_the_graph_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    """Two modules importing each other, one of them inside a function, are a cycle."""
    graph = {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
