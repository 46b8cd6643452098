"""pipeline/filters.py: normalisation, exact-dedupe hash, quality filters and the train/val split."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from pipeline.filters import check_filters, content_hash, count_control_chars, normalise_text, split_for
from pipeline.manifest import FilterConfig
from pipeline.schemas import REJECT_REASONS


def test_normalise_text_canonicalises_unicode_line_ends_and_edges() -> None:
    decomposed = "Cafe\u0301"  # e + combining acute accent
    text = f"\n  \r\n\t{decomposed} \t\r\n    indented  \rlast line   \n\n  \n"
    assert normalise_text(text) == "\tCaf\u00e9\n    indented\nlast line"


def test_normalise_text_is_idempotent_on_real_source() -> None:
    source = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text(encoding="utf-8")
    once = normalise_text(source)
    assert normalise_text(once) == once
    assert once.splitlines()[0] == source.splitlines()[0].rstrip()


def test_content_hash_ignores_whitespace_changes_only() -> None:
    original = "def f(x):\n    return x + 1\n"
    reindented = "def  f(x):\r\n\treturn x +   1"
    assert content_hash(normalise_text(original)) == content_hash(normalise_text(reindented))
    assert content_hash(original) != content_hash(original.replace("x + 1", "x + 2"))
    assert len(content_hash(original)) == 32  # hex xxh3-128


@pytest.mark.parametrize(
    ("text", "filters", "reason"),
    [
        ("", FilterConfig(), "empty"),
        ("short", FilterConfig(min_chars=10), "too_short"),
        ("x" * 101, FilterConfig(max_chars=100), "too_long"),
        ("\x00" * 50 + "some text", FilterConfig(), "binary"),
        ("text with one \x07 bell among many characters" * 10, FilterConfig(max_control_char_fraction=0.0), "binary"),
    ],
)
def test_check_filters_reports_documented_reasons(text: str, filters: FilterConfig, reason: str) -> None:
    failed = check_filters(text, filters)
    assert failed is not None
    assert failed[0] == reason
    assert failed[0] in REJECT_REASONS
    assert failed[1]  # a human-readable detail


def test_check_filters_passes_ordinary_text_with_allowed_whitespace_controls() -> None:
    text = "col1\tcol2\nrow\x0bwith vertical tab\x0cand form feed"
    assert count_control_chars(text) == 0
    assert check_filters(text, FilterConfig(max_control_char_fraction=0.0)) is None


def test_split_for_is_deterministic_and_near_the_fraction() -> None:
    hashes = [content_hash(f"document number {i}") for i in range(4000)]
    splits = [split_for(h, 0.1) for h in hashes]
    assert splits == [split_for(h, 0.1) for h in hashes]
    assert 0.08 < splits.count("val") / len(splits) < 0.12
    assert all(split_for(h, 0.0) == "train" for h in hashes)
