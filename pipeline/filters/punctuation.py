"""Filter stage data: datatrove 0.10's punctuation sets (``datatrove/utils/text.py``), which the web-grade filters
(:mod:`pipeline.filters.web_filters`) read as datatrove does. Generated from them, not edited, and kept as data
(``pipeline/data/punctuation.json``, package data read once here, found by this file's path as
:mod:`pipeline.filters.english_exceptions` says); ``tests/pipeline/test_generated_data.py`` compares them
with datatrove's."""

from __future__ import annotations

import json
from pathlib import Path

_SETS: dict[str, str] = json.loads(
    (Path(__file__).parents[1] / "data" / "punctuation.json").read_text(encoding="utf-8"))

TERMINAL_PUNCTUATION = frozenset(_SETS["terminal_punctuation"])
"""Characters that end a sentence in some script (Unicode Sentence_Terminal): FineWeb's ``line_punct_ratio``."""

PUNCTUATION = frozenset(_SETS["punctuation"]) | TERMINAL_PUNCTUATION
"""ASCII and common CJK punctuation, control characters and the terminal marks: a word made only of these is no
word to Gopher's counts."""
