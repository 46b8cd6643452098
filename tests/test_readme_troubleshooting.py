"""docs/troubleshooting.md "Messages": every message it lists is one the code really writes (wording included).

A row's message is quoted in backticks with ``…`` (and single capital letters: ``N``, ``H``) standing for
what varies; each literal piece of it (8 characters or more) must occur in the code. A reworded error
fails here until the README follows.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("core", "pipeline", "tokenization", "trainer", "flows")


def troubleshooting_messages() -> list[str]:
    text = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    section = text.split("\n## Messages\n", 1)[1].split("\n## ", 1)[0]
    messages = []
    for row in re.findall(r"^\| (.+?) \| .+ \|$", section, re.M):
        messages += re.findall(r"`([^`]+)`", row)
    return messages


def literal_pieces(message: str) -> list[str]:
    """The parts of a message that do not vary, split at ``…``, capital-letter placeholders and punctuation
    (the code builds messages from f-string pieces, sometimes across lines)."""
    pieces = (piece.strip(" '\"") for piece in re.split(r"…|\b[A-Z]\b|[()\[\]:;]", message.removeprefix("FAULT ")))
    return [piece for piece in pieces if len(piece) >= 8]


def test_every_troubleshooting_message_is_written_by_the_code() -> None:
    code = "\n".join(path.read_text(encoding="utf-8") for folder in CODE_FOLDERS
                     for path in sorted((REPO / folder).rglob("*.py")))
    code += "\n".join(path.read_text(encoding="utf-8") for path in sorted((REPO / "tests").rglob("*.py"))
                      if path.name != Path(__file__).name)  # the Chromium message is the report test's
    code = code.replace("`", "")  # the page quotes messages in code spans, without their inner backticks
    messages = troubleshooting_messages()
    assert len(messages) >= 12
    missing = {message: piece for message in messages for piece in literal_pieces(message) if piece not in code}
    assert missing == {}
