"""docs/architecture.md lists every module of every package and sub-package: a module added or moved shows here.

On a failure the assertion prints the block to paste between the two markers of that page.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
BEGIN = "<!-- sub-packages: kept equal to the packages by tests/test_docs_modules.py -->"
END = "<!-- end of sub-packages -->"
WIDTH = 116
"""Characters a line of the listing may take."""


def modules_block() -> str:
    """The listing as the page shows it: each package and sub-package, its modules sorted and wrapped."""
    lines: list[str] = []
    for package in PACKAGES:
        folders = sorted(path.parent for path in (REPO / package).rglob("__init__.py"))
        for folder in folders:
            depth = len(folder.relative_to(REPO / package).parts)
            label = f"{package}/" if depth == 0 else "  " * depth + folder.relative_to(REPO / package).as_posix() + "/"
            names = sorted(path.stem for path in folder.glob("*.py") if path.name != "__init__.py")
            lines.extend(wrapped(label, names))
    return "\n".join(lines)


def wrapped(label: str, names: list[str]) -> list[str]:
    text, lines = f"{label:<20}", []
    for name in names:
        piece = name if text.endswith(" ") else f", {name}"
        if len(text) + len(piece) > WIDTH:
            lines.append(text + ",")
            text, piece = " " * 20, name
        text += piece
    return [*lines, text]


def test_the_architecture_page_lists_every_module() -> None:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{ARCHITECTURE}: the markers of the module listing are missing"
    listed = text.partition(BEGIN)[2].partition(END)[0].partition("```\n")[2].partition("\n```")[0]
    expected = modules_block()
    assert listed == expected, f"paste this between the ``` of the listing in {ARCHITECTURE}:\n{expected}"
