"""Filter stage: the web-grade quality filters FineWeb runs (Gopher quality and repetition, C4, FineWeb's own), on a
normalised text, as datatrove 0.10's classes decide them.

Each returns None for a document it keeps, else the reject's detail: ``rule=<name>`` (the rule that fired, as
datatrove names it) then the measured value and the ``filters.<filter>.<key>`` threshold it crossed. Rules run in
datatrove's order and the first that fires decides. Each filter is its ``*_values`` (every statistic its rules
compare: the ``attributes`` a run stores) then its ``*_verdict`` (the thresholds over them), so a threshold change
re-decides from stored values. Words come from :func:`pipeline.filters.words.split_words`; the
agreement with datatrove is measured in ``tests/pipeline/test_web_filters.py``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pipeline.filters.punctuation import PUNCTUATION, TERMINAL_PUNCTUATION
from pipeline.filters.web_filter_config import C4Config, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from pipeline.filters.words import count_sentences, split_words

_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAKS = re.compile(r"\n+")
_CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
"""C4's cookie and terms-of-use phrases (TensorFlow Datasets ``c4_utils.py``): a line with one is removed."""
_TERMINAL_PUNCTUATION = tuple(TERMINAL_PUNCTUATION)


class NotMeasured(KeyError):
    """A statistic a verdict reads was never measured: ingest stopped at an earlier failing rule (or filter)."""


class LazyStatistics(dict[str, Any]):
    """A filter's statistics, each computed when a verdict first reads it: a verdict that fails early leaves the
    later ones unmeasured (and absent), so measuring costs what deciding did. ``producers``: key -> a function
    returning its value, or a dict of values (one pass that yields several)."""

    def __init__(self, producers: dict[str, Callable[[], Any]]) -> None:
        super().__init__()
        self._producers = producers

    def __missing__(self, key: str) -> Any:
        produce = self._producers.get(key)
        if produce is None:
            raise NotMeasured(key)
        produced = produce()
        self.update(produced if isinstance(produced, dict) else {key: produced})
        return dict.__getitem__(self, key)


class Cached:
    """A value computed on first call (lines of a text that several statistics share)."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute, self._value, self._done = compute, None, False

    def __call__(self) -> Any:
        if not self._done:
            self._value, self._done = self._compute(), True
        return self._value


N_GRAM_COLUMNS = {"top": "gopher_repetition_top_n_gram_char_frac", "dup": "gopher_repetition_dup_n_gram_char_frac"}
_N_GRAM_KEY = re.compile(r"gopher_repetition_(top|dup)_(\d+)_gram\Z")


def storable_statistics(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the per-n Gopher n-gram statistics gathered into their ``{n: share}`` map columns."""
    stored: dict[str, Any] = {}
    for key, value in values.items():
        match = _N_GRAM_KEY.match(key)
        if match is None:
            stored[key] = value
        else:
            stored.setdefault(N_GRAM_COLUMNS[match.group(1)], {})[int(match.group(2))] = value
    return stored


class StoredStatistics(Mapping[str, Any]):
    """A stored attributes row as a verdict reads it: a null value was not measured (:class:`NotMeasured`), and a
    per-n Gopher n-gram statistic is looked up in its map column."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self._row = row

    def __getitem__(self, key: str) -> Any:
        match = _N_GRAM_KEY.match(key)
        if match is None:
            value = self._row.get(key)
        else:  # a map column reads back as (n, share) pairs
            value = dict(self._row.get(N_GRAM_COLUMNS[match.group(1)]) or ()).get(int(match.group(2)))
        if value is None:
            raise NotMeasured(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)


def _failure(rule: str, measured: str, key: str, threshold: object) -> str:
    return f"rule={rule} {measured}; filters.{key}={threshold}"


def gopher_quality_failure(text: str, words: list[str], config: GopherQualityConfig) -> str | None:
    """The detail of the first Gopher quality rule ``text`` (split into ``words``) fails, else None."""
    return gopher_quality_verdict(gopher_quality_statistics(text, words, config), config)


def gopher_quality_statistics(text: str, words: list[str], config: GopherQualityConfig) -> LazyStatistics:
    """What Gopher's quality rules compare (``gopher_quality_*`` attributes), each computed when a rule first reads
    it; of ``config`` only ``stop_words`` is read (the thresholds are :func:`gopher_quality_verdict`'s)."""
    num_words = max(len(words), 1)
    lines = Cached(lambda: text.splitlines() or [""])

    def counts() -> dict[str, Any]:
        lengths = [len(word) for word in words if not PUNCTUATION.issuperset(word)]
        return {"gopher_quality_num_words": len(lengths),
                "gopher_quality_mean_word_length": sum(lengths) / len(lengths) if lengths else None}

    return LazyStatistics({
        "gopher_quality_num_words": counts, "gopher_quality_mean_word_length": counts,
        "gopher_quality_hashes_per_word": lambda: text.count("#") / num_words,
        "gopher_quality_ellipses_per_word": lambda: (text.count("...") + text.count("…")) / num_words,
        "gopher_quality_bullet_lines_ratio":
            lambda: sum(line.lstrip().startswith(("•", "-")) for line in lines()) / len(lines()),
        "gopher_quality_ellipsis_lines_ratio":
            lambda: sum(line.rstrip().endswith(("...", "…")) for line in lines()) / len(lines()),
        "gopher_quality_alpha_words_ratio":
            lambda: sum(any(character.isalpha() for character in word) for word in words) / num_words,
        "gopher_quality_num_stop_words": lambda: len(set(config.stop_words).intersection(words)),
    })


def gopher_quality_verdict(values: Mapping[str, Any], config: GopherQualityConfig) -> str | None:
    """The detail of the first Gopher quality rule the ``values`` fail under ``config``, else None (a rule that is
    off reads nothing, and rules after the failing one are not read)."""
    num_words = values["gopher_quality_num_words"]
    if config.min_doc_words is not None and num_words < config.min_doc_words:
        return _failure("gopher_short_doc", f"words={num_words}", "gopher_quality.min_doc_words", config.min_doc_words)
    if config.max_doc_words is not None and num_words > config.max_doc_words:
        return _failure("gopher_long_doc", f"words={num_words}", "gopher_quality.max_doc_words", config.max_doc_words)
    if num_words:
        mean_length = values["gopher_quality_mean_word_length"]
        if config.min_avg_word_length is not None and mean_length < config.min_avg_word_length:
            return _failure("gopher_below_avg_threshold", f"mean_word_length={mean_length:.2f}",
                            "gopher_quality.min_avg_word_length", config.min_avg_word_length)
        if config.max_avg_word_length is not None and mean_length > config.max_avg_word_length:
            return _failure("gopher_above_avg_threshold", f"mean_word_length={mean_length:.2f}",
                            "gopher_quality.max_avg_word_length", config.max_avg_word_length)
    if config.max_symbol_word_ratio is not None:
        for rule, key in (("gopher_too_many_hashes", "gopher_quality_hashes_per_word"),
                          ("gopher_too_many_ellipsis", "gopher_quality_ellipses_per_word")):
            if values[key] > config.max_symbol_word_ratio:
                return _failure(rule, f"per_word={values[key]:.3f}", "gopher_quality.max_symbol_word_ratio",
                                config.max_symbol_word_ratio)
    for rule, key, setting in (
            ("gopher_too_many_bullets", "gopher_quality_bullet_lines_ratio", "max_bullet_lines_ratio"),
            ("gopher_too_many_end_ellipsis", "gopher_quality_ellipsis_lines_ratio", "max_ellipsis_lines_ratio")):
        limit = getattr(config, setting)
        if limit is not None and values[key] > limit:
            return _failure(rule, f"line_share={values[key]:.3f}", f"gopher_quality.{setting}", limit)
    if config.min_alpha_words_ratio is not None and values["gopher_quality_alpha_words_ratio"] < \
            config.min_alpha_words_ratio:
        return _failure("gopher_below_alpha_threshold",
                        f"alpha_word_share={values['gopher_quality_alpha_words_ratio']:.3f}",
                        "gopher_quality.min_alpha_words_ratio", config.min_alpha_words_ratio)
    if config.min_stop_words is not None and values["gopher_quality_num_stop_words"] < config.min_stop_words:
        return _failure("gopher_enough_stop_words", f"stop_words={values['gopher_quality_num_stop_words']}",
                        "gopher_quality.min_stop_words", config.min_stop_words)
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
    return gopher_repetition_verdict(gopher_repetition_statistics(text, words, config), config)


def gopher_repetition_statistics(text: str, words: list[str], config: GopherRepetitionConfig) -> LazyStatistics:
    """What Gopher's repetition rules compare, each computed when a rule first reads it: ``gopher_repetition_dup_
    {para,line}_{frac,char_frac}``, ``gopher_repetition_top_<n>_gram`` and ``..._dup_<n>_gram`` (stored as the
    ``{n: share}`` maps of :func:`storable_statistics`; NaN: a top n-gram longer than the text). Of ``config`` only
    the n are read."""
    num_chars = len(text)
    lengths = Cached(lambda: list(map(len, words)))

    def pieces(unit: str, split: list[str]) -> Callable[[], dict[str, Any]]:
        def share() -> dict[str, Any]:
            num_duplicates, num_duplicate_chars = _duplicates(split)
            return {f"gopher_repetition_dup_{unit}_frac": num_duplicates / len(split),
                    f"gopher_repetition_dup_{unit}_char_frac": num_duplicate_chars / num_chars}
        return share

    def top_share(n: int) -> float:
        if len(words) < n:
            return math.nan
        # Word tuples, not joined strings: the same counts (words hold no spaces) without building a string each.
        top_gram, count = Counter(zip(*(words[i:] for i in range(n)), strict=False)).most_common(1)[0]
        return (sum(map(len, top_gram)) + n - 1) * count / num_chars

    paragraphs = pieces("para", _PARAGRAPH_BREAK.split(text.strip()))
    lines = pieces("line", _LINE_BREAKS.split(text))
    producers: dict[str, Callable[[], Any]] = {
        "gopher_repetition_dup_para_frac": paragraphs, "gopher_repetition_dup_para_char_frac": paragraphs,
        "gopher_repetition_dup_line_frac": lines, "gopher_repetition_dup_line_char_frac": lines}
    for n in config.top_n_grams:
        producers[f"gopher_repetition_top_{n}_gram"] = lambda n=n: top_share(n)
    for n in config.dup_n_grams:
        producers[f"gopher_repetition_dup_{n}_gram"] = (
            lambda n=n: _repeated_n_gram_chars(words, lengths(), n) / num_chars)
    return LazyStatistics(producers)


def gopher_repetition_verdict(values: Mapping[str, Any], config: GopherRepetitionConfig) -> str | None:
    """The detail of the first Gopher repetition rule the ``values`` fail under ``config``, else None."""
    for unit in ("para", "line"):
        share_limit, char_limit = getattr(config, f"dup_{unit}_frac"), getattr(config, f"dup_{unit}_char_frac")
        share = values[f"gopher_repetition_dup_{unit}_frac"]
        if share_limit is not None and share > share_limit:
            return _failure(f"dup_{unit}_frac", f"share={share:.3f}", f"gopher_repetition.dup_{unit}_frac", share_limit)
        char_share = values[f"gopher_repetition_dup_{unit}_char_frac"]
        if char_limit is not None and char_share > char_limit:
            return _failure(f"dup_{unit}_char_frac", f"char_share={char_share:.3f}",
                            f"gopher_repetition.dup_{unit}_char_frac", char_limit)
    for n, limit in config.top_n_grams.items():
        share = values[f"gopher_repetition_top_{n}_gram"]
        if share > limit:  # NaN (fewer words than n) never is
            return _failure(f"top_{n}_gram", f"char_share={share:.3f}", f"gopher_repetition.top_n_grams.{n}", limit)
    for n, limit in config.dup_n_grams.items():
        share = values[f"gopher_repetition_dup_{n}_gram"]
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
    values, kept_text = c4_values(text, config)
    failure = c4_verdict(values, config)
    return failure, text if failure is not None else kept_text


def c4_values(text: str, config: C4Config) -> tuple[dict[str, Any], str]:
    """``(what C4's page rules compare, the kept lines)``: the sentences in the kept lines, their characters, and the
    first line (0-based) reaching the lorem ipsum and the curly bracket rule with one. Lines go on past both rules,
    as with those rules off (a document either rule rejects keeps nothing). The page rules' settings
    (``min_num_sentences``, ``filter_lorem_ipsum``, ``filter_curly_bracket``) are read in :func:`c4_verdict` only."""
    num_sentences = 0
    kept_lines = []
    lorem_line = curly_line = None
    for number, line in enumerate(text.splitlines()):
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
        if lorem_line is None and "lorem ipsum" in lowered:
            lorem_line = number
        if config.filter_javascript and "javascript" in lowered:
            continue
        if curly_line is None and "{" in line:
            curly_line = number
        if config.filter_policy and any(phrase in lowered for phrase in C4_POLICY_PHRASES):
            continue
        num_sentences += count_sentences(split_words(line))
        kept_lines.append(line)
    kept_text = "\n".join(kept_lines).strip()
    return {"c4_num_sentences": num_sentences, "c4_kept_chars": len(kept_text), "c4_lorem_ipsum_line": lorem_line,
            "c4_curly_bracket_line": curly_line}, kept_text


def c4_verdict(values: Mapping[str, Any], config: C4Config) -> str | None:
    """The detail of the C4 page rule the measured ``values`` fail under ``config`` (the earliest line's), else None."""
    kept_chars = values["c4_kept_chars"]  # first: C4 is measured whole or not at all
    lorem = values.get("c4_lorem_ipsum_line") if config.filter_lorem_ipsum else None
    curly = values.get("c4_curly_bracket_line") if config.filter_curly_bracket else None
    if lorem is not None and (curly is None or lorem <= curly):
        return _failure("lorem_ipsum", "phrase=lorem_ipsum", "c4.filter_lorem_ipsum", "true")
    if curly is not None:
        return _failure("curly_bracket", "char={", "c4.filter_curly_bracket", "true")
    num_sentences = values["c4_num_sentences"]
    if config.min_num_sentences is not None and num_sentences < config.min_num_sentences:
        return _failure("too_few_sentences", f"sentences={num_sentences}", "c4.min_num_sentences",
                        config.min_num_sentences)
    if not kept_chars:  # only with min_num_sentences off; datatrove would keep an empty document
        return _failure("no_lines_kept", "lines=0", "c4.min_num_sentences", config.min_num_sentences)
    return None


def fineweb_failure(text: str, words: list[str], config: FineWebConfig) -> str | None:
    """The detail of the first FineWeb line rule ``text`` fails, else None."""
    return fineweb_verdict(fineweb_statistics(text, words, config), config)


def fineweb_statistics(text: str, words: list[str], config: FineWebConfig) -> LazyStatistics:
    """What FineWeb's line rules compare (``fineweb_*`` attributes), each computed when a rule first reads it; of
    ``config`` only ``short_line_length`` is read."""
    lines = Cached(lambda: [line for line in text.split("\n") if line.strip()])
    return LazyStatistics({
        "fineweb_num_lines": lambda: len(lines()),
        "fineweb_line_punct_ratio":
            lambda: sum(line.endswith(_TERMINAL_PUNCTUATION) for line in lines()) / len(lines()),
        "fineweb_short_line_ratio":
            lambda: sum(len(line) <= config.short_line_length for line in lines()) / len(lines()),
        "fineweb_char_dup_ratio": lambda: _duplicates(lines())[1] / (len(text) - text.count("\n")),
        "fineweb_new_line_ratio": lambda: text.count("\n") / max(len(words), 1),
    })


def fineweb_verdict(values: Mapping[str, Any], config: FineWebConfig) -> str | None:
    """The detail of the first FineWeb line rule the measured ``values`` fail under ``config``, else None."""
    if not values["fineweb_num_lines"]:
        return _failure("empty", "lines=0", "fineweb.line_punct_thr", config.line_punct_thr)
    ratio = values["fineweb_line_punct_ratio"]
    if ratio < config.line_punct_thr and not (ratio == 0 and config.line_punct_exclude_zero):
        return _failure("line_punct_ratio", f"line_share={ratio:.3f}", "fineweb.line_punct_thr", config.line_punct_thr)
    ratio = values["fineweb_short_line_ratio"]
    if ratio > config.short_line_thr:
        return _failure("short_line_ratio", f"line_share={ratio:.3f}", "fineweb.short_line_thr", config.short_line_thr)
    ratio = values["fineweb_char_dup_ratio"]
    if ratio > config.char_duplicates_ratio:
        return _failure("char_dup_ratio", f"char_share={ratio:.3f}", "fineweb.char_duplicates_ratio",
                        config.char_duplicates_ratio)
    ratio = values["fineweb_new_line_ratio"]
    if ratio > config.new_line_ratio:
        return _failure("list_ratio", f"newlines_per_word={ratio:.3f}", "fineweb.new_line_ratio",
                        config.new_line_ratio)
    return None
