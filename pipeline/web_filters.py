"""Filter stage: the web-grade quality filters FineWeb runs (Gopher quality and repetition, C4, FineWeb's own), on a
normalised text, as datatrove 0.10's classes decide them.

Each returns None for a document it keeps, else the reject's detail: ``rule=<name>`` (the rule that fired, as
datatrove names it) then the measured value and the ``filters.<filter>.<key>`` threshold it crossed. Rules run in
datatrove's order and the first that fires decides. Words come from :func:`pipeline.words.split_words`; the
agreement with datatrove is measured in ``tests/pipeline/test_web_filters.py``.
"""

from __future__ import annotations

import re
from collections import Counter

from pipeline.punctuation import PUNCTUATION, TERMINAL_PUNCTUATION
from pipeline.web_filter_config import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from pipeline.words import count_sentences, split_words

_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAKS = re.compile(r"\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
"""C4's cookie and terms-of-use phrases (TensorFlow Datasets ``c4_utils.py``): a line with one is removed."""
_TERMINAL_PUNCTUATION = tuple(TERMINAL_PUNCTUATION)


def _failure(rule: str, measured: str, key: str, threshold: object) -> str:
    return f"rule={rule} {measured}; filters.{key}={threshold}"


def gopher_quality_failure(text: str, words: list[str], config: GopherQualityConfig) -> str | None:
    """The detail of the first Gopher quality rule ``text`` (split into ``words``) fails, else None."""
    non_symbol_lengths = [len(word) for word in words if not PUNCTUATION.issuperset(word)]
    num_non_symbol = len(non_symbol_lengths)
    if config.min_doc_words is not None and num_non_symbol < config.min_doc_words:
        return _failure("gopher_short_doc", f"words={num_non_symbol}", "gopher_quality.min_doc_words",
                        config.min_doc_words)
    if config.max_doc_words is not None and num_non_symbol > config.max_doc_words:
        return _failure("gopher_long_doc", f"words={num_non_symbol}", "gopher_quality.max_doc_words",
                        config.max_doc_words)
    if num_non_symbol:
        mean_length = sum(non_symbol_lengths) / num_non_symbol
        if config.min_avg_word_length is not None and mean_length < config.min_avg_word_length:
            return _failure("gopher_below_avg_threshold", f"mean_word_length={mean_length:.2f}",
                            "gopher_quality.min_avg_word_length", config.min_avg_word_length)
        if config.max_avg_word_length is not None and mean_length > config.max_avg_word_length:
            return _failure("gopher_above_avg_threshold", f"mean_word_length={mean_length:.2f}",
                            "gopher_quality.max_avg_word_length", config.max_avg_word_length)
    num_words = max(len(words), 1)
    return _gopher_symbol_and_line_failure(text, num_words, config) or _gopher_word_failure(words, num_words, config)


def _gopher_symbol_and_line_failure(text: str, num_words: int, config: GopherQualityConfig) -> str | None:
    if config.max_symbol_word_ratio is not None:
        for rule, count in (("gopher_too_many_hashes", text.count("#")),
                            ("gopher_too_many_ellipsis", text.count("...") + text.count("…"))):
            if count / num_words > config.max_symbol_word_ratio:
                return _failure(rule, f"per_word={count / num_words:.3f}", "gopher_quality.max_symbol_word_ratio",
                                config.max_symbol_word_ratio)
    lines = text.splitlines() or [""]
    if config.max_bullet_lines_ratio is not None:
        ratio = sum(line.lstrip().startswith(("•", "-")) for line in lines) / len(lines)
        if ratio > config.max_bullet_lines_ratio:
            return _failure("gopher_too_many_bullets", f"line_share={ratio:.3f}",
                            "gopher_quality.max_bullet_lines_ratio", config.max_bullet_lines_ratio)
    if config.max_ellipsis_lines_ratio is not None:
        ratio = sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines)
        if ratio > config.max_ellipsis_lines_ratio:
            return _failure("gopher_too_many_end_ellipsis", f"line_share={ratio:.3f}",
                            "gopher_quality.max_ellipsis_lines_ratio", config.max_ellipsis_lines_ratio)
    return None


def _gopher_word_failure(words: list[str], num_words: int, config: GopherQualityConfig) -> str | None:
    if config.min_alpha_words_ratio is not None:
        ratio = sum(any(character.isalpha() for character in word) for word in words) / num_words
        if ratio < config.min_alpha_words_ratio:
            return _failure("gopher_below_alpha_threshold", f"alpha_word_share={ratio:.3f}",
                            "gopher_quality.min_alpha_words_ratio", config.min_alpha_words_ratio)
    if config.min_stop_words is not None:
        num_present = len(set(config.stop_words).intersection(words))
        if num_present < config.min_stop_words:
            return _failure("gopher_enough_stop_words", f"stop_words={num_present}", "gopher_quality.min_stop_words",
                            config.min_stop_words)
    return None


def _duplicates(elements: list[str]) -> tuple[int, int]:
    """``(elements repeating an earlier one, their characters)``."""
    num_unique = len(set(elements))
    if num_unique == len(elements):
        return 0, 0
    seen: set[str] = set()
    num_chars = 0
    for element in elements:
        if element in seen:
            num_chars += len(element)
        else:
            seen.add(element)
    return len(elements) - num_unique, num_chars


def gopher_repetition_failure(text: str, words: list[str], config: GopherRepetitionConfig) -> str | None:
    """The detail of the first Gopher repetition rule ``text`` fails, else None (datatrove's order: paragraphs,
    lines, top n-grams, duplicated n-grams)."""
    num_chars = len(text)
    for unit, pieces in (("para", _PARAGRAPH_BREAK.split(text.strip())), ("line", _LINE_BREAKS.split(text))):
        num_duplicates, num_duplicate_chars = _duplicates(pieces)
        share_limit, char_limit = getattr(config, f"dup_{unit}_frac"), getattr(config, f"dup_{unit}_char_frac")
        if share_limit is not None and num_duplicates / len(pieces) > share_limit:
            return _failure(f"dup_{unit}_frac", f"share={num_duplicates / len(pieces):.3f}",
                            f"gopher_repetition.dup_{unit}_frac", share_limit)
        if char_limit is not None and num_duplicate_chars / num_chars > char_limit:
            return _failure(f"dup_{unit}_char_frac", f"char_share={num_duplicate_chars / num_chars:.3f}",
                            f"gopher_repetition.dup_{unit}_char_frac", char_limit)
    for n, limit in config.top_n_grams.items():
        if len(words) < n:
            continue
        # Word tuples, not joined strings: the same counts (words hold no spaces) without building a string each.
        top_gram, count = Counter(zip(*(words[i:] for i in range(n)), strict=False)).most_common(1)[0]
        top_chars = (sum(map(len, top_gram)) + n - 1) * count
        if top_chars / num_chars > limit:
            return _failure(f"top_{n}_gram", f"char_share={top_chars / num_chars:.3f}",
                            f"gopher_repetition.top_n_grams.{n}", limit)
    lengths = list(map(len, words))
    for n, limit in config.dup_n_grams.items():
        share = _repeated_n_gram_chars(words, lengths, n) / num_chars
        if share > limit:
            return _failure(f"duplicated_{n}_n_grams", f"char_share={share:.3f}",
                            f"gopher_repetition.dup_n_grams.{n}", limit)
    return None


def _repeated_n_gram_chars(words: list[str], lengths: list[int], n: int) -> int:
    """Characters of word n-grams repeating an earlier n-gram, counting each repeat once and skipping past it.

    N-grams are compared as word tuples; datatrove compares the words joined without spaces, where ("ab", "c")
    and ("a", "bc") are one n-gram (a difference ``tests/pipeline/test_web_filters.py`` has not met on real text).
    """
    n_grams = list(zip(*(words[i:] for i in range(n)), strict=False))  # shorter tails end it
    if len(set(n_grams)) == len(n_grams):
        return 0
    seen: set[tuple[str, ...]] = set()
    num_chars, index, num_n_grams = 0, 0, len(n_grams)
    while index < num_n_grams:
        n_gram = n_grams[index]
        if n_gram in seen:
            num_chars += sum(lengths[index:index + n])
            index += n
        else:
            seen.add(n_gram)
            index += 1
    return num_chars


def c4_failure(text: str, config: C4Config) -> tuple[str | None, str]:
    """``(detail of the C4 rule that rejects text, else None; the kept lines joined by newlines)``.

    Line rules, in datatrove's order: a word over ``max_word_length`` removes the line; citations are deleted; a
    line without terminal punctuation or with too few words is removed; "lorem ipsum" rejects the document;
    "javascript" removes the line; ``{`` rejects the document; a policy phrase removes the line.
    """
    num_sentences = 0
    kept_lines = []
    for line in text.splitlines():
        line = line.strip()
        words = line.split()
        if config.max_word_length is not None and any(len(word) > config.max_word_length for word in words):
            continue
        if config.remove_citations and "[" in line:
            line = _CITATION.sub("", line)
        if config.filter_no_terminal_punct and (not line.endswith(C4_END_PUNCTUATION) or line.endswith("...")):
            continue
        if config.min_words_per_line is not None and len(words) < config.min_words_per_line:
            continue
        lowered = line.lower()
        if config.filter_lorem_ipsum and "lorem ipsum" in lowered:
            return _failure("lorem_ipsum", "phrase=lorem_ipsum", "c4.filter_lorem_ipsum", "true"), text
        if config.filter_javascript and "javascript" in lowered:
            continue
        if config.filter_curly_bracket and "{" in line:
            return _failure("curly_bracket", "char={", "c4.filter_curly_bracket", "true"), text
        if config.filter_policy and any(phrase in lowered for phrase in C4_POLICY_PHRASES):
            continue
        if config.min_num_sentences is not None:
            num_sentences += count_sentences(split_words(line))
        kept_lines.append(line)
    if config.min_num_sentences is not None and num_sentences < config.min_num_sentences:
        return _failure("too_few_sentences", f"sentences={num_sentences}", "c4.min_num_sentences",
                        config.min_num_sentences), text
    kept_text = "\n".join(kept_lines).strip()
    if not kept_text:  # only with min_num_sentences off; datatrove would keep an empty document
        return _failure("no_lines_kept", "lines=0", "c4.min_num_sentences", config.min_num_sentences), text
    return None, kept_text


def fineweb_failure(text: str, words: list[str], config: FineWebConfig) -> str | None:
    """The detail of the first FineWeb line rule ``text`` fails, else None."""
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return _failure("empty", "lines=0", "fineweb.line_punct_thr", config.line_punct_thr)
    ratio = sum(line.endswith(_TERMINAL_PUNCTUATION) for line in lines) / len(lines)
    if ratio < config.line_punct_thr and not (ratio == 0 and config.line_punct_exclude_zero):
        return _failure("line_punct_ratio", f"line_share={ratio:.3f}", "fineweb.line_punct_thr", config.line_punct_thr)
    ratio = sum(len(line) <= config.short_line_length for line in lines) / len(lines)
    if ratio > config.short_line_thr:
        return _failure("short_line_ratio", f"line_share={ratio:.3f}", "fineweb.short_line_thr", config.short_line_thr)
    ratio = _duplicates(lines)[1] / (len(text) - text.count("\n"))
    if ratio > config.char_duplicates_ratio:
        return _failure("char_dup_ratio", f"char_share={ratio:.3f}", "fineweb.char_duplicates_ratio",
                        config.char_duplicates_ratio)
    ratio = text.count("\n") / max(len(words), 1)
    if ratio > config.new_line_ratio:
        return _failure("list_ratio", f"newlines_per_word={ratio:.3f}", "fineweb.new_line_ratio",
                        config.new_line_ratio)
    return None
