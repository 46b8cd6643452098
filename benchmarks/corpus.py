"""The benchmarks' shared corpus: the running interpreter's standard-library source, real text on every machine."""

from __future__ import annotations

import re
import sysconfig
import unicodedata
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


MAN_ROOT = Path("/usr/share/man")
_ROFF_TEXT_MACROS = {"SH", "SS", "B", "I", "BR", "RB", "IR", "RI", "BI", "IB", "SM", "SB", "TP", "IP", "Nm", "Nd", "Sh"}
_ROFF_ESCAPES = re.compile(r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[+-]?\d+|\(..|\[[^\]]*\]|\*(?:\(..|\[[^\]]*\]|.)|[&%:|^c]|.)")
_ROFF_ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", ",": "\u0327"}
_ROFF_ACCENTED = re.compile(r"\\(?:\(|\[)([:'`^~,])([A-Za-z])\]?")
_ROFF_UNICODE = re.compile(r"\\\[u([0-9A-Fa-f]{4,6})\]")
_ROFF_CHARACTERS = {"\\(ss": "ß", "\\[ss]": "ß", "\\(cq": "'",
                    "\\-": "-", "\\e": "\\", "\\ ": " ", "\\~": " ", "\\(aq": "'", "\\(em": "—", "\\(en": "–",
                    "\\(dq": '"', "\\(lq": "“", "\\(rq": "”", "\\[aq]": "'", "\\[em]": "—"}


def roff_to_text(source: str) -> str:
    """The running text of a man page's roff source: macro lines dropped except those that carry text, escapes
    removed. Rough (tables and conditionals come out as they are), but every word is the page's own."""
    lines = []
    for line in source.splitlines():
        if line.startswith((".", "'")):
            macro, _, arguments = line[1:].strip().partition(" ")
            if macro not in _ROFF_TEXT_MACROS or not arguments:
                continue
            line = arguments.replace('"', "")
        for escape, character in _ROFF_CHARACTERS.items():
            line = line.replace(escape, character)
        line = _ROFF_ACCENTED.sub(lambda match: match.group(2) + _ROFF_ACCENTS[match.group(1)], line)
        line = _ROFF_UNICODE.sub(lambda match: chr(int(match.group(1), 16)), line)
        lines.append(_ROFF_ESCAPES.sub("", line))
    return unicodedata.normalize("NFC", "\n".join(lines))


def man_page_texts(language: str, max_pages: int, min_words: int = 50) -> list[tuple[str, str]]:
    """``(file name, running text)`` of up to ``max_pages`` installed manual pages in ``language`` (``en``: the
    untranslated pages in ``/usr/share/man/man*``; others: ``/usr/share/man/<language>/``), in path order."""
    import gzip

    folder = MAN_ROOT if language == "en" else MAN_ROOT / language
    pages = []
    for path in sorted(folder.glob("man[1-8]/*")):
        if not path.is_file():
            continue
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = roff_to_text(raw.decode("utf-8", "replace"))
        if len(text.split()) >= min_words and not text.lstrip().startswith("so "):
            pages.append((path.name, text))
            if len(pages) == max_pages:
                break
    return pages


DEBIAN_DOC_NAMES = re.compile(r"(README|NEWS|changelog|copyright|AUTHORS|TODO|THANKS|FAQ|CONTRIBUTING)[^/]*\Z")
"""Debian's package documentation worth reading as prose: read-me, news, change logs, licences (not examples)."""


def debian_doc_texts(max_docs: int, root: str = "/usr/share/doc") -> list[tuple[str, str]]:
    """``(path, text)`` of up to ``max_docs`` UTF-8 package documents under ``root`` (gzipped ones decompressed), in
    path order: real prose, lists and logs of every length, the mix web-grade quality filters are built for."""
    import gzip

    found = []
    for path in sorted(Path(root).rglob("*")):
        if not DEBIAN_DOC_NAMES.match(path.name) or not path.is_file() or path.is_symlink():
            continue
        try:
            data = path.read_bytes()
            text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError):
            continue
        if text.strip():
            found.append((str(path.relative_to(root)), text))
            if len(found) == max_docs:
                break
    return found
