"""The benchmarks' shared corpus: the running interpreter's standard-library source, real text on every machine."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_texts(max_bytes: int, min_words: int = 0, max_words: int = 10**9) -> list[str]:
    """Standard-library ``.py`` files (no site-packages, UTF-8 only) in path order until ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
        if min_words <= len(text.split()) <= max_words:
            texts.append(text)
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
    return texts


def site_packages_texts(max_bytes: int) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the running environment's site-packages ``.py`` files, in path order, until
    ``max_bytes``: real code with the copies real corpora have (vendored packages, generated stubs)."""
    root = Path(sysconfig.get_paths()["purelib"])
    found, total = [], 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.split():
            continue  # empty __init__.py files: nothing to dedupe or tokenize
        found.append((str(path.relative_to(root)), text))
        total += len(text.encode("utf-8"))
        if total >= max_bytes:
            break
    return found


def stdlib_docstring_texts(max_bytes: int, min_words: int = 0, max_words: int = 10**9) -> list[str]:
    """Real English prose on every machine: the docstrings of each top-level standard-library module, one text per
    module (module, class and function docstrings in source order, blank-line separated), in path order."""
    import ast

    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree, *(node for node in ast.walk(tree)
                          if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
        text = "\n\n".join(doc for node in nodes if (doc := ast.get_docstring(node)))
        if min_words <= len(text.split()) <= max_words:
            texts.append(text)
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                break
    return texts
