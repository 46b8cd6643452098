"""Filter stage data: the special cases of spaCy 3.8's English tokenizer (MIT licence), which ``pipeline.filters.words``
keeps whole or splits as spaCy does ("don't" -> "do", "n't"; "e.g." whole; ":)" whole).

Generated, not edited, and kept as data (``pipeline/data/english_special_cases.json``, package data read once here,
found by this file's path: Prefect may load ``flows/pipeline.py`` under the name ``pipeline``):
``{key: [token[ORTH] for token in value] for key, value in spacy.blank("en").tokenizer.rules.items()}``
(whitespace keys left out); ``tests/pipeline/test_generated_data.py`` compares it with spaCy's.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_CASES: dict[str, tuple[str, ...]] = {
    key: tuple(pieces) for key, pieces in
    json.loads((Path(__file__).parents[1] / "data" / "english_special_cases.json").read_text(encoding="utf-8")).items()
}
