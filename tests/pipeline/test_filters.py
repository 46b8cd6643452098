"""pipeline/filters.py: normalisation, exact-dedupe hash, quality filters and the train/val split."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from core.schemas import REJECT_REASONS
from pipeline.filters import (
    check_filters,
    content_hash,
    count_control_chars,
    count_symbols,
    duplicate_line_fraction,
    normalise_text,
    redact_pii,
    split_for,
)
from pipeline.manifest import FilterConfig, load_manifest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
DEFAULT_MANIFEST = Path(__file__).resolve().parents[2] / "data_manifests" / "python-stdlib.yaml"
BASE64_LINE = "QmluYXJ5IGRhdGEgZW5jb2RlZCBhcyBiYXNlNjQgbG9va3MgbGlrZSBvbmUgdmVyeSBsb25nIHdvcmQgcGVyIGxpbmUu"


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
        ("\n".join([BASE64_LINE] * 40), FilterConfig(max_duplicate_line_fraction=1.0), "mean_word_length"),
        ("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 20, FilterConfig(), "mean_word_length"),
        ("+--------+--------+\n| a      | b      |\n+--------+--------+\n" * 3, FilterConfig(), "symbol_ratio"),
        ("\u2500\u2500\u2500\u2500 \u2502 box \u2502 \u2500\u2500\u2500\u2500", FilterConfig(), "symbol_ratio"),
        ("BUY NOW at the lowest price ever!\n" * 30 + "unsubscribe", FilterConfig(), "duplicate_lines"),
    ],
)
def test_check_filters_reports_documented_reasons(text: str, filters: FilterConfig, reason: str) -> None:
    failed = check_filters(text, filters)
    assert failed is not None
    assert failed[0] == reason
    assert failed[0] in REJECT_REASONS
    assert failed[1]  # a human-readable detail


def test_default_filters_keep_the_stdlib_and_its_prose() -> None:
    # The default corpus: only empty and too-short files are rejected (``__init__.py`` stubs and the like).
    filters = load_manifest(DEFAULT_MANIFEST).filters
    reasons: dict[str, list[str]] = {}
    for path in sorted(STDLIB.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = normalise_text(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        failed = check_filters(text, filters)
        if failed is not None:
            reasons.setdefault(failed[0], []).append(path.name)
    assert set(reasons) <= {"empty", "too_short"}, {reason: names[:5] for reason, names in reasons.items()}
    assert sum(map(len, reasons.values())) < 50
    import pydoc_data.topics  # the Python reference manual's prose, shipped with the stdlib

    topics = [normalise_text(text) for text in pydoc_data.topics.topics.values()]
    assert len(topics) > 50
    assert [check_filters(text, FilterConfig()) for text in topics] == [None] * len(topics)


def test_word_and_symbol_counts_agree_on_ascii_and_unicode_paths() -> None:
    ascii_text = "def f(x_1):\n    return {'a': x_1 ** 2}  # ok\x1cend"
    assert count_symbols(ascii_text) == sum(1 for c in ascii_text if not c.isalnum() and not c.isspace())
    mixed = ascii_text + " caf\u00e9 \u2192 na\u00efve \u00a0\u2500\u2500"
    assert count_symbols(mixed) == sum(1 for c in mixed if not c.isalnum() and not c.isspace())
    for text in (ascii_text, mixed):  # mean word length uses str.split()'s words on both paths
        words = text.split()
        expected = sum(map(len, words)) / len(words)
        loose = {"max_control_char_fraction": 1.0, "max_symbol_ratio": 9.0}
        failed = check_filters(text, FilterConfig(max_mean_word_length=expected - 0.01, **loose))
        assert failed is not None and failed[0] == "mean_word_length"
        assert check_filters(text, FilterConfig(max_mean_word_length=expected + 0.01, **loose)) is None


def test_duplicate_line_fraction_weighs_characters() -> None:
    assert duplicate_line_fraction("one line\nanother line") == 0.0
    assert duplicate_line_fraction("abc\nabc\nabc\nabc") == 0.75
    short_repeats = "\n".join(["    else:", "x = compute_something_long(1)", "    else:", "y = compute_other_thing(2)"])
    assert 0.0 < duplicate_line_fraction(short_repeats) < 0.2


def test_redact_pii_replaces_emails_and_ips_but_not_code() -> None:
    text = ("Contact john.doe+tag@example.co.uk. or bob@mail.example.com; server 192.168.0.1, end 10.0.0.255.\n"
            "ipv6 2001:db8::8a2e:370:7334 and 2001:0db8:85a3:0000:0000:8a2e:0370:7334 and ::ffff:192.0.2.128\n")
    code = ("@property\ndef f(a@b): return x[1::2], y[::], a@b, std::vector, 12:30:45, v1.2.3.4, 1.2.3.4.5, "
            "256.1.1.1, fe80::1, ::1")
    redacted, counts = redact_pii(text + code)
    assert counts == {"email": 2, "ip": 5}
    assert redacted == ("Contact <EMAIL>. or <EMAIL>; server <IP>, end <IP>.\n"
                        "ipv6 <IP> and <IP> and <IP>\n") + code
    assert redact_pii(code) == (code, {})


def test_redaction_runs_before_hashing_so_pii_variants_collapse() -> None:
    first, _ = redact_pii("Written by Ann <ann@example.org> at 10.1.2.3")
    second, _ = redact_pii("Written by Ann <ann.b@corp.example.com> at 172.16.0.9")
    assert first == second
    assert content_hash(first) == content_hash(second)


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
