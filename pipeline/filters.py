"""Filter stage: normalise each ingested text, hash it for exact dedupe, reject low-quality documents.

Every function here runs once per document on the ingest hot path, so each is built from C-speed
``str`` methods and compiled regexes; no Python loop visits individual characters.
"""

from __future__ import annotations

import re
import unicodedata

import xxhash

from pipeline.manifest import FilterConfig

# C0 controls except \t \n \v \f \r, DEL and the C1 block: what binary data decoded as text is made of.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")


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


def content_hash(text: str) -> str:
    """Exact-dedupe key: hex xxh3-128 of ``text`` with every whitespace run collapsed to one space.

    Collapsing whitespace makes re-indented or re-wrapped copies exact duplicates of each other.
    """
    return xxhash.xxh3_128_hexdigest(" ".join(text.split()).encode("utf-8"))


def count_control_chars(text: str) -> int:
    """Number of NUL/control characters other than ``\\t \\n \\v \\f \\r``."""
    return _CONTROL_CHARS.subn("", text)[1]


def check_filters(text: str, filters: FilterConfig) -> tuple[str, str] | None:
    """``(reason, detail)`` when the normalised ``text`` fails a quality filter, else None.

    Reasons are ``REJECT_REASONS`` keys: empty, too_long, binary, too_short (checked in that order, so
    a huge binary blob is reported as too_long without scanning it).
    """
    num_chars = len(text)
    if num_chars == 0:
        return "empty", "no text left after normalisation"
    if num_chars > filters.max_chars:
        return "too_long", f"{num_chars} characters, above filters.max_chars={filters.max_chars}"
    num_control = count_control_chars(text)
    if num_control / num_chars > filters.max_control_char_fraction:
        return "binary", (
            f"{num_control} of {num_chars} characters are NUL/control characters "
            f"({num_control / num_chars:.1%}), above filters.max_control_char_fraction="
            f"{filters.max_control_char_fraction}"
        )
    if num_chars < filters.min_chars:
        return "too_short", f"{num_chars} characters, below filters.min_chars={filters.min_chars}"
    return None


def split_for(text_hash: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` from the content hash, so a text and all its copies land on the same side."""
    return "val" if int(text_hash[:16], 16) / 2**64 < val_fraction else "train"
