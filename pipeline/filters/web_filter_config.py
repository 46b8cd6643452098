"""Corpus manifests: settings of the web-grade quality filters (``filters.gopher_quality``, ``gopher_repetition``,
``c4``, ``fineweb``), each with the defaults its paper and datatrove 0.10 publish; :mod:`pipeline.filters.web_filters`
runs them.

A setting of ``null`` turns that one rule off, as datatrove's ``None`` does.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from core.config import FrozenConfig

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
NGramSize = Annotated[int, Field(ge=1, le=100)]
GOPHER_STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
"""Gopher's stop words (Rae et al. 2021, §A.1.1): a document needs ``min_stop_words`` of them (case-sensitive words)."""


class GopherQualityConfig(FrozenConfig):
    """``filters.gopher_quality``: Gopher's quality rules (Rae et al. 2021, arXiv:2112.11446, §A.1.1), as datatrove's
    ``GopherQualityFilter``. Words are those of :func:`pipeline.filters.words.split_words`; "words" in the counts below
    leave out words made only of punctuation, except in the ratios' denominators (as datatrove)."""

    min_doc_words: Annotated[int, Field(ge=0)] | None = 50
    """Fewest non-punctuation words (rule ``gopher_short_doc``)."""
    max_doc_words: Annotated[int, Field(ge=1)] | None = 100_000
    """Most non-punctuation words (rule ``gopher_long_doc``)."""
    min_avg_word_length: Annotated[float, Field(ge=0.0)] | None = 3.0
    """Least mean characters per non-punctuation word (rule ``gopher_below_avg_threshold``)."""
    max_avg_word_length: Annotated[float, Field(gt=0.0)] | None = 10.0
    """Most mean characters per non-punctuation word (rule ``gopher_above_avg_threshold``)."""
    max_symbol_word_ratio: Annotated[float, Field(ge=0.0)] | None = 0.1
    """Most ``#`` per word, and most ellipses (``...``, ``…``) per word (rules ``gopher_too_many_hashes``,
    ``gopher_too_many_ellipsis``)."""
    max_bullet_lines_ratio: Fraction | None = 0.9
    """Most share of lines starting with ``•`` or ``-`` (rule ``gopher_too_many_bullets``)."""
    max_ellipsis_lines_ratio: Fraction | None = 0.3
    """Most share of lines ending with an ellipsis (rule ``gopher_too_many_end_ellipsis``)."""
    min_alpha_words_ratio: Fraction | None = 0.8
    """Least share of words with a letter in them (rule ``gopher_below_alpha_threshold``; datatrove's
    ``max_non_alpha_words_ratio``)."""
    min_stop_words: Annotated[int, Field(ge=0)] | None = 2
    """Fewest distinct ``stop_words`` present (rule ``gopher_enough_stop_words``)."""
    stop_words: tuple[str, ...] = GOPHER_STOP_WORDS
    """The stop words ``min_stop_words`` counts (English; give your language's for another)."""

    @model_validator(mode="after")
    def _bounds_ordered(self) -> GopherQualityConfig:
        for low, high in (("min_doc_words", "max_doc_words"), ("min_avg_word_length", "max_avg_word_length")):
            low_value, high_value = getattr(self, low), getattr(self, high)
            if low_value is not None and high_value is not None and low_value > high_value:
                raise ValueError(f"{low}={low_value} is above {high}={high_value}: no document could pass; swap or "
                                 "fix them")
        return self


class GopherRepetitionConfig(FrozenConfig):
    """``filters.gopher_repetition``: Gopher's repetition rules (Rae et al. 2021, Table A1), as datatrove's
    ``GopherRepetitionFilter``. Character fractions are of the whole text's characters."""

    dup_para_frac: Fraction | None = 0.3
    """Most share of paragraphs (split at blank lines) repeating an earlier one (rule ``dup_para_frac``)."""
    dup_para_char_frac: Fraction | None = 0.2
    """Most share of characters in repeated paragraphs (rule ``dup_para_char_frac``)."""
    dup_line_frac: Fraction | None = 0.3
    """Most share of lines repeating an earlier one (rule ``dup_line_frac``)."""
    dup_line_char_frac: Fraction | None = 0.2
    """Most share of characters in repeated lines (rule ``dup_line_char_frac``)."""
    top_n_grams: dict[NGramSize, Fraction] = {2: 0.2, 3: 0.18, 4: 0.16}
    """``{n: fraction}``: most share of characters in the most frequent word n-gram (rules ``top_<n>_gram``)."""
    dup_n_grams: dict[NGramSize, Fraction] = {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    """``{n: fraction}``: most share of characters in word n-grams repeating an earlier one (rules
    ``duplicated_<n>_n_grams``)."""


class C4Config(FrozenConfig):
    """``filters.c4``: C4's line and page rules (Raffel et al. 2020, JMLR 21(140), §2.2), as datatrove's
    ``C4QualityFilter`` with lines split at line ends. Lines failing a line rule are removed from the text."""

    remove_lines: bool = True
    """Keep only the lines that pass, as C4 does (the document's ``text``, ``num_chars`` and ``content_hash`` are
    then those of the kept lines); false: decide keep/reject from them but store the text unchanged."""
    remove_citations: bool = True
    """Delete Wikipedia-style citation marks (``[1]``, ``[edit]``, ``[citation needed]``) from each line."""
    filter_no_terminal_punct: bool = True
    """Remove lines not ending in ``. ? ! " '`` (or ending in ``...``). FineWeb's own pipeline sets this false."""
    min_num_sentences: Annotated[int, Field(ge=0)] | None = 5
    """Fewest sentences in the kept lines (rule ``too_few_sentences``)."""
    min_words_per_line: Annotated[int, Field(ge=0)] | None = 3
    """Remove lines with fewer whitespace-separated words."""
    max_word_length: Annotated[int, Field(ge=1)] | None = 1000
    """Remove lines with a longer word (characters)."""
    filter_lorem_ipsum: bool = True
    """Reject a document with "lorem ipsum" in a line (rule ``lorem_ipsum``)."""
    filter_javascript: bool = True
    """Remove lines mentioning "javascript"."""
    filter_curly_bracket: bool = True
    """Reject a document with ``{`` in a line (rule ``curly_bracket``): code, templates."""
    filter_policy: bool = True
    """Remove lines with "terms of use", "privacy policy", "cookie policy", "uses cookies", ... in them."""


class FineWebConfig(FrozenConfig):
    """``filters.fineweb``: FineWeb's own line-level rules (Penedo et al. 2024, arXiv:2406.17557, §3.4), as
    datatrove's ``FineWebQualityFilter``. Lines are the non-blank lines."""

    line_punct_thr: Fraction = 0.12
    """Least share of lines ending in terminal punctuation (rule ``line_punct_ratio``)."""
    line_punct_exclude_zero: bool = False
    """Keep documents where no line ends in terminal punctuation (skip ``line_punct_thr`` when the share is 0)."""
    short_line_thr: Fraction = 0.67
    """Most share of lines of at most ``short_line_length`` characters (rule ``short_line_ratio``)."""
    short_line_length: Annotated[int, Field(ge=0)] = 30
    """Characters up to which a line counts as short."""
    char_duplicates_ratio: Fraction = 0.01
    """Most share of (non-newline) characters in lines repeating an earlier line (rule ``char_dup_ratio``)."""
    new_line_ratio: Annotated[float, Field(ge=0.0)] = 0.3
    """Most newlines per word (rule ``list_ratio``)."""
