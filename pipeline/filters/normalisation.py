"""Ingest stage: the canonical form of a document's text, before it is filtered, hashed or classified.

Its own module because the filters (:mod:`pipeline.filters.screen`), ingest, decontamination and the quality classifier
(:mod:`pipeline.filters.quality_classifier`) all see a text in this form, and the classifier is itself one of the
filters.
"""

from __future__ import annotations

import unicodedata


def normalise_text(text: str) -> str:
    """Canonical form of a document: NFC, ``\\n`` line ends, no trailing spaces, no blank edge lines.

    Leading indentation is kept (it is meaningful in code and poetry); only whitespace at the end of a
    line and blank lines at the start and end of the text are removed.
    """
    text = unicodedata.normalize("NFC", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    # split/rstrip/join measured ~6x faster than a MULTILINE regex on the stdlib sources.
    return "\n".join([line.rstrip() for line in text.split("\n")]).strip("\n")
