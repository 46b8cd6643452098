"""pipeline/filters/screen.py: normalisation, exact-dedupe hash, quality filters and the train/val split."""

from __future__ import annotations

import ast
import inspect
import itertools
import re
import sysconfig
from pathlib import Path

import pytest

from core.schemas import NON_FILTER_REJECT_REASONS
from pipeline.filters.language import model_path
from pipeline.filters.normalisation import normalise_text
from pipeline.filters.screen import (
    QUALITY_FILTERS,
    REJECT_REASONS,
    MeasuredText,
    check_filters,
    content_hash,
    count_control_chars,
    count_symbols,
    duplicate_line_fraction,
    redact_pii,
    split_for,
)
from pipeline.manifest import FilterConfig, QualityClassifierConfig, checked_classifier, load_manifest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
REPO = Path(__file__).resolve().parents[2]
DEFAULT_MANIFEST = REPO / "data_manifests" / "python-stdlib.yaml"
ENGLISH_CLASSIFIER = checked_classifier(QualityClassifierConfig(path=str(model_path()), label="en"), "m.yaml")
"""fastText's lid.176 is a classifier too: as ``filters.quality_classifier`` with label ``en``, it rejects German."""
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


FAILING_EXAMPLES = [
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
    ("Der schnelle braune Fuchs springt über den faulen Hund und läuft dann weiter in den Wald.",
     FilterConfig(language={"allowed": ["en"]}), "language"),
    ("The same line again and again.\n" * 10, FilterConfig(gopher_repetition={}), "gopher_repetition"),
    ("Too short to be a page of the web.", FilterConfig(gopher_quality={}), "gopher_quality"),
    ("One sentence. Two sentences. Three sentences.", FilterConfig(c4={}), "c4"),
    ("a list\nof short lines\nwithout any\npunctuation at the end", FilterConfig(fineweb={}), "fineweb"),
    ("Der schnelle braune Fuchs springt über den faulen Hund und läuft dann weiter in den Wald.",
     FilterConfig(quality_classifier=ENGLISH_CLASSIFIER), "quality_classifier"),
]
"""``(text, filters, reason)``: a document each quality filter rejects."""
CHECK_ORDER = ("empty", "too_long", "binary", "too_short", "mean_word_length", "symbol_ratio", "duplicate_lines",
               "language", "gopher_repetition", "gopher_quality", "c4", "fineweb", "quality_classifier")
"""The quality filters' documented order (docs/manifest.md, ``check_filters``): the first failing one is the reason."""
NON_FILTER_FIELDS = {"redact_pii"}
"""``FilterConfig`` fields no quality filter reads: redaction replaces text, it never rejects."""


@pytest.mark.parametrize(("text", "filters", "reason"), FAILING_EXAMPLES)
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


@pytest.mark.parametrize(
    ("text", "filters", "first", "also"),
    [
        ("\x00" * 300, FilterConfig(max_chars=100), "too_long", "binary"),  # a huge blob is not scanned
        ("\x00" * 5, FilterConfig(min_chars=10), "binary", "too_short"),
        ("x" * 50, FilterConfig(min_chars=100), "too_short", "mean_word_length"),
        ("+-" * 30, FilterConfig(), "mean_word_length", "symbol_ratio"),
        (normalise_text("+--+ |\n" * 30), FilterConfig(), "symbol_ratio", "duplicate_lines"),
    ],
)
def test_check_filters_reports_the_first_failing_filter(text: str, filters: FilterConfig, first: str,
                                                        also: str) -> None:
    failed = check_filters(text, filters)
    assert failed is not None and failed[0] == first
    later = next(row for row in QUALITY_FILTERS if row.reason == also)
    assert later.check(MeasuredText(text), filters) is not None  # the text fails the later filter too


def test_filter_table_runs_in_the_documented_order_and_completes_reject_reasons() -> None:
    reasons = [row.reason for row in QUALITY_FILTERS]
    assert tuple(reasons) == CHECK_ORDER
    assert not set(reasons) & set(NON_FILTER_REJECT_REASONS)
    assert set(REJECT_REASONS) == set(NON_FILTER_REJECT_REASONS) | set(reasons)
    assert all(REJECT_REASONS[row.reason] == row.meaning and row.meaning for row in QUALITY_FILTERS)
    assert all(REJECT_REASONS[reason] == meaning for reason, meaning in NON_FILTER_REJECT_REASONS.items())
    assert {reason for _, _, reason in FAILING_EXAMPLES} == set(reasons)  # every filter has a failing example


def filter_config_docstrings() -> dict[str, str]:
    """``{field: docstring}`` of ``FilterConfig``, read from its source (pydantic keeps no attribute docstrings)."""
    body = ast.parse(inspect.getsource(FilterConfig)).body[0].body
    return {node.target.id: following.value.value for node, following in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)}


def test_every_filter_config_field_is_read_by_one_filter_that_its_docstring_and_detail_name() -> None:
    fields = [field for row in QUALITY_FILTERS for field in row.config_fields]
    assert sorted(fields) == sorted(set(FilterConfig.model_fields) - NON_FILTER_FIELDS)  # each exactly once
    docstrings = filter_config_docstrings()
    assert set(docstrings) == set(FilterConfig.model_fields)
    details = {reason: check_filters(text, filters)[1] for text, filters, reason in FAILING_EXAMPLES}
    for row in QUALITY_FILTERS:
        for field in row.config_fields:
            assert f"``{row.reason}``" in docstrings[field], field
            assert field in details[row.reason], (row.reason, field)  # the reject says which key to change


def readme_reject_reasons() -> list[str]:
    """The reasons docs/formats.md's ``Reject reasons:`` paragraph lists, in its order."""
    formats = (REPO / "docs" / "formats.md").read_text(encoding="utf-8")
    paragraph = formats.split("\nReject reasons:", 1)[1].split("\n\n")[0]
    return re.findall(r"`([a-z0-9_]+)`", paragraph.split("(see `REJECT_REASONS`", 1)[0])


def readme_filters_block() -> dict[str, str]:
    """``{key: comment}`` of the ``filters:`` block in the manifest reference, docs/manifest.md."""
    block = (REPO / "docs" / "manifest.md").read_text(encoding="utf-8").split("\nfilters:", 1)[1].split("\n```", 1)[0]
    entries = {}
    for line in block.splitlines()[1:]:
        match = re.fullmatch(r"  (\w+): [^#]*?(?:#\s*(.*))?", line)
        assert match is not None, f"README filters: block, unexpected line {line!r}"
        entries[match[1]] = match[2] or ""
    return entries


def test_readme_lists_every_reject_reason_and_names_each_filter_at_its_keys() -> None:
    listed = readme_reject_reasons()
    assert sorted(listed) == sorted(REJECT_REASONS)  # each once
    comments = readme_filters_block()
    assert list(comments) == list(FilterConfig.model_fields)
    for row in QUALITY_FILTERS:
        if row.config_fields:
            assert re.match(rf"{row.reason}\b", comments[row.config_fields[0]]), (row.reason, comments)


def data_docs_filter_table() -> dict[str, tuple[str, str | None]]:
    """``{key: (default as written, reason or None)}`` from docs/data.md's quality-filter table."""
    section = (REPO / "docs" / "data.md").read_text(encoding="utf-8").split("## Quality filters", 1)[1]
    rows = {}
    for line in section.split("\n\n")[2].splitlines()[2:]:
        keys, defaults, reasons = (re.findall(r"`(\w+)`", cell) or cell.strip() for cell in line.strip("|").split("|"))
        defaults = [part.split()[0].replace(",", "") for part in defaults.split(" / ")]
        for i, key in enumerate(keys):
            rows[key] = (defaults[i], reasons[min(i, len(reasons) - 1)] if isinstance(reasons, list) else None)
    return rows


def test_data_docs_table_gives_each_key_its_default_and_reason() -> None:
    reason_of = {field: row.reason for row in QUALITY_FILTERS for field in row.config_fields}
    table = data_docs_filter_table()
    assert list(table) == list(FilterConfig.model_fields)
    for key, default in FilterConfig().model_dump().items():
        written, reason = table[key]
        assert reason == reason_of.get(key), key
        if default is None:  # an optional filter, off by default
            assert written == "null", key
        else:
            assert (written == str(default).lower() if isinstance(default, bool) else float(written) == default), key
