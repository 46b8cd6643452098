"""Every document the project points at is in the project, and so is every section it names.

A reference is a path into docs/ or an upper-case top-level document (README.md, SECURITY.md), named in a
comment or docstring of the code and tests, in the other tracked text files (shell scripts, YAML, TOML, .ci/),
or in README.md and the docs pages, where a Markdown link to a page counts too, taken from the page's own folder.
A section reference (the README or a page, then a quoted heading or phrase; a comma, a closing link bracket or
"'s" may come between) must name text of that document. The code once cited documents kept outside the project,
and sections the README later moved into docs/: a reader following them found nothing.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENT = re.compile(r"(?<![\w/.-])(docs/[\w-]+\.md|[A-Z][A-Z0-9_-]*\.md)\b")
"""A project document named in text: a docs page from the repository root, or an upper-case top-level file."""
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
SECTION = re.compile(r"(README(?:\.md)?|(?<![\w/.-])(?:docs/)?[\w-]+\.md)\)?(?:'s)?,? \"([^\"\n]+)\"")
"""A document, then the quoted heading or phrase it names (group 1, group 2)."""
TEXT_SUFFIXES = (".sh", ".yaml", ".yml", ".toml", ".cfg", ".txt")


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in filter(None, listed.decode().split("\0")) if (REPO / name).is_file()]


def comments_and_docstrings(source: str) -> str:
    """The comments and docstrings of a Python module, one per line (string literals that are data stay out)."""
    found = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):  # every docstring is a bare string statement
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append(node.value.value)
    return "\n".join(found)


def prose(path: Path) -> str:
    """The text of ``path`` that may point at documents: all of it, or a Python module's comments and docstrings."""
    text = path.read_text(encoding="utf-8")
    return comments_and_docstrings(text) if path.suffix == ".py" else text


def referring_files() -> list[Path]:
    """Code, tests, docs and the other tracked text files (``.ci/run`` has no suffix)."""
    return [path for path in tracked_files()
            if path.suffix in (".py", ".md", *TEXT_SUFFIXES) or path.parent.name == ".ci"]


def resolve(name: str, referrer: Path) -> Path:
    """A document name as written in ``referrer``: ``README`` is README.md; a page name beside the referring page
    (docs/recipe.md writes ``training.md``) is that page; anything else is from the repository root."""
    if name == "README":
        return REPO / "README.md"
    beside = referrer.parent / name
    return beside if referrer.suffix == ".md" and "/" not in name and beside.is_file() else REPO / name


def references(path: Path) -> list[str]:
    """Every document ``path`` names, as written."""
    text = prose(path)
    names = DOCUMENT.findall(text)
    if path.suffix == ".md":
        names += [link for link in MARKDOWN_LINK.findall(text) if "://" not in link]
    return names


def missing_documents(path: Path) -> list[str]:
    return [name for name in references(path) if not resolve(name, path).is_file()]


def missing_sections(path: Path) -> list[str]:
    """``document "text"`` references whose text is not in that document (a heading, or words of it)."""
    missing = []
    for name, text in SECTION.findall(prose(path)):
        document = resolve(name, path)
        if not document.is_file() or text not in document.read_text(encoding="utf-8"):
            missing.append(f'{name} "{text}"')
    return missing


FILES = referring_files()


def test_the_scanner_finds_references_in_comments_docstrings_and_links(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""See GONE.md."""\n\nx = "docs/absent.md"  # docs/also-absent.md, README "No such part"\n')
    assert sorted(references(module)) == ["GONE.md", "docs/also-absent.md"]  # the string literal is data
    assert missing_sections(module) == ['README "No such part"']
    page = tmp_path / "page.md"
    page.write_text('[the formats](formats.md) and [x](https://example.org/y.md); see [data.md](data.md), "Nope"\n')
    assert references(page) == ["formats.md", "data.md"]


def test_every_referenced_document_exists() -> None:
    assert len(FILES) > 100, "the scan found too few files"
    missing = {str(path.relative_to(REPO)): names for path in FILES if (names := missing_documents(path))}
    assert missing == {}, "documents the project lacks, by the file that points at them"


def test_every_referenced_section_is_in_its_document() -> None:
    missing = {str(path.relative_to(REPO)): names for path in FILES if (names := missing_sections(path))}
    assert missing == {}, "sections their documents lack, by the file that names them"
