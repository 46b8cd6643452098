"""README and docs tables: every ``| … |`` row renders as a table row, never as a paragraph of literal pipes.

A line of text between two rows ends the table there: the rows after it rendered as ``| … |`` text (the
README's folder table did). markdown-it-py (rich's Markdown parser) with GitHub's table extension decides.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rows_outside_tables(text: str) -> list[str]:
    """The lines that look like table rows (``| … |``) but do not render inside a table."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    in_table = {line for token in tokens if token.type == "table_open" and token.map
                for line in range(*token.map)}
    in_code = {line for token in tokens if token.type in ("fence", "code_block") and token.map
               for line in range(*token.map)}
    return [line for number, line in enumerate(text.splitlines())
            if line.startswith("|") and line.rstrip().endswith("|") and number not in in_table | in_code]


def test_a_line_between_two_rows_is_caught() -> None:
    broken = "| a | b |\n|---|---|\n| 1 | 2 |\n\nstray line\n| 3 | 4 |\n"
    assert rows_outside_tables(broken) == ["| 3 | 4 |"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_table_row_renders_in_a_table(document: Path) -> None:
    assert rows_outside_tables(document.read_text(encoding="utf-8")) == []
