"""Filter stage helper: English words and sentences as the web-grade quality filters count them.

Gopher, C4 and FineWeb's published filters count *words* the way datatrove 0.10 splits them: spaCy's rule-based
English tokenizer (whitespace chunks, then prefix, suffix and infix punctuation split off, contractions and
dotted abbreviations kept as spaCy's exceptions keep them). This is a pure-``re`` rendering of those rules, so
tokenmill needs no spaCy; ``tests/pipeline/test_web_filters.py`` measures how often the filters' decisions
agree with datatrove's own classes on real documents. Letter classes are approximated by Latin, Greek and
Cyrillic ranges (spaCy lists every script), which only matters for the case-sensitive rules below.
"""

from __future__ import annotations

import re

from pipeline.filters.english_exceptions import SPECIAL_CASES

_LOWER = "a-zß-öø-ÿα-ωа-яё"
_UPPER = "A-ZÀ-ÖØ-ÞΑ-ΩА-ЯЁ"
_QUOTES = "'\"”“`‘´’‚,„»«「」『』（）〔〕【】《》〈〉〈〉⟦⟧"
# spaCy's LIST_PUNCT, LIST_QUOTES and currency signs (spacy/lang/char_classes.py): split off a chunk's ends.
_PUNCT_CHARS = "…,:;!?¿؟¡()[]{}<>_#*&。？！，、；：～·।،۔؛٪"
_CURRENCY_CHARS = "$£€¥฿₽₹₩₪₫₴₦₱"
# spaCy's UNITS, longest first: split off a number's end ("100%" -> "100", "%"; "5km" -> "5", "km").
_UNIT_NAMES = ("km km² km³ m m² m³ dm dm² dm³ cm cm² cm³ mm mm² mm³ ha µm nm yd in ft kg g mg µg t lb oz m/s km/h "
               "kmh mph hPa Pa mbar mb MB kb KB gb GB tb TB T G M K %")
_UNITS = "|".join(sorted((re.escape(unit) for unit in _UNIT_NAMES.split()), key=len, reverse=True))
# Most of spaCy's LIST_ICONS (Unicode "other symbols": ©, ®, °, arrows, dingbats, emoji): always split off.
_ICONS = ("[\u00a6\u00a9\u00ae\u00b0\u2100-\u214f\u2190-\u21ff\u2300-\u23ff\u2460-\u27bf\u2b00-\u2bff"
          "\U0001f000-\U0001faff]")
_PREFIX = re.compile(_ICONS + r"|[§%=—–]|\+(?![0-9])|\.\.+|…|["
                     + re.escape(_PUNCT_CHARS + _QUOTES + _CURRENCY_CHARS) + "]")
_SUFFIX = re.compile(r"(?:" + _ICONS + r"|\.\.+|…|['’][sS]|[—–]|[" + re.escape(_PUNCT_CHARS + _QUOTES) + r"]"
                     r"|(?<=[0-9])\+|(?<=[0-9])[" + re.escape(_CURRENCY_CHARS) + r"]|(?<=[0-9])(?:" + _UNITS + ")"
                     r"|(?<=[0-9" + _LOWER + r"%²\-+" + re.escape(_PUNCT_CHARS + _QUOTES) + r"])\."
                     r"|(?<=[" + _UPPER + "][" + _UPPER + r"])\.)\Z")
_SPECIALS_WITH_PUNCTUATION = frozenset(key for key in SPECIAL_CASES if not key.isalnum())
_MAX_SPECIAL_PIECES = 5
_SUFFIX_DOT = re.compile(r"\.\Z")
_INFIX = re.compile(_ICONS + r"|\.\.+|…|(?<=[0-9])[+\-*^](?=[0-9-])"
                    r"|(?<=[" + _LOWER + re.escape(_QUOTES) + r"])\.(?=[" + _UPPER + re.escape(_QUOTES) + r"])"
                    r"|(?<=[^\W\d_]),(?=[^\W\d_])"
                    r"|(?<=[^\W_])(?:---|--|——|[-–—~])(?=[^\W\d_])"
                    r"|(?<=[^\W_])[:<>=/](?=[^\W\d_])")
# spaCy's URL_MATCH (spacy/lang/tokenizer_exceptions.py, after Diego Perini's MIT-licensed URL regex): a URL or
# e-mail address left after the affixes are peeled stays one word.
_URL = re.compile(
    r"(?:(?:[\w\+\-\.]{2,})://)?(?:\S+(?::\S*)?@)?(?:(?!(?:10|127)(?:\.\d{1,3}){3})"
    r"(?!(?:169\.254|192\.168)(?:\.\d{1,3}){2})(?!172\.(?:1[6-9]|2\d|3[0-1])(?:\.\d{1,3}){2})"
    r"(?:[1-9]\d?|1\d\d|2[01]\d|22[0-3])(?:\.(?:1?\d{1,2}|2[0-4]\d|25[0-5])){2}(?:\.(?:[1-9]\d?|1\d\d|2[0-4]\d|25[0-4]))"
    r"|(?:(?:[A-Za-z0-9\u00a1-\uffff][A-Za-z0-9\u00a1-\uffff_-]{0,62})?[A-Za-z0-9\u00a1-\uffff]\.)+"
    r"(?:[" + _LOWER + r"]{2,63}))(?::\d{2,5})?(?:[/?#]\S*)?\Z")
SENTENCE_END_CHARS = frozenset("!.?։؟۔܀܁܂߹।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᰻᰼᱾᱿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡。")
"""spaCy's sentencizer's ``default_punct_chars`` (scripts tokenmill sees): a token of one of these ends a sentence."""


def _split_infixes(core: str, tokens: list[str]) -> None:
    """Append ``core`` split at its infixes (hyphens between letters, "..." inside a word, ...)."""
    start = 0
    for match in _INFIX.finditer(core):
        if match.start() > start:
            tokens.append(core[start:match.start()])
        tokens.append(match.group(0))
        start = match.end()
    if start < len(core):
        tokens.append(core[start:])


def _split_chunk(chunk: str, tokens: list[str]) -> None:
    """Append the tokens of one whitespace-free ``chunk``, peeling prefixes and suffixes as spaCy does, then
    joining adjacent pieces that spell a special case with punctuation in it ("):", "''", "8)")."""
    pieces: list[str] = []
    _peel_chunk(chunk, pieces)
    if len(pieces) > 1:
        pieces = _join_special_pieces(pieces)
    tokens.extend(pieces)


def _join_special_pieces(pieces: list[str]) -> list[str]:
    """``pieces`` with each run of adjacent ones spelling a special case replaced by its tokens (longest first),
    as spaCy 3's special-case matcher does after splitting affixes."""
    joined: list[str] = []
    index = 0
    while index < len(pieces):
        for end in range(min(len(pieces), index + _MAX_SPECIAL_PIECES), index + 1, -1):
            spelled = "".join(pieces[index:end])
            if spelled in _SPECIALS_WITH_PUNCTUATION:
                joined.extend(SPECIAL_CASES[spelled])
                index = end
                break
        else:
            joined.append(pieces[index])
            index += 1
    return joined


def _peel_chunk(chunk: str, tokens: list[str]) -> None:
    """Append the tokens of ``chunk``: prefixes, then the core (special case, URL or split at infixes), suffixes."""
    suffixes: list[str] = []
    while chunk and chunk not in SPECIAL_CASES:
        prefix = _PREFIX.match(chunk)
        if prefix is not None and len(chunk) > prefix.end():
            tokens.append(prefix.group(0))
            chunk = chunk[prefix.end():]
            continue
        suffix = _SUFFIX.search(chunk)
        if suffix is None and chunk[-1] == "." and len(chunk) > 1 and chunk[-2].islower():
            suffix = _SUFFIX_DOT.search(chunk)  # "." after any script's lower-case letter, as spaCy's ALPHA_LOWER
        if suffix is not None and suffix.start() > 0:
            suffixes.append(suffix.group(0))
            chunk = chunk[:suffix.start()]
            continue
        break
    if chunk:
        if chunk in SPECIAL_CASES:
            tokens.extend(SPECIAL_CASES[chunk])
        elif len(chunk) == 1 or _URL.match(chunk) is not None:
            tokens.append(chunk)
        else:
            _split_infixes(chunk, tokens)
    tokens.extend(reversed(suffixes))


def split_words(text: str) -> list[str]:
    """The words (tokens, punctuation included) of ``text`` as datatrove's English word tokenizer returns them."""
    tokens: list[str] = []
    for chunk in text.split():
        if chunk.isalpha() and chunk not in SPECIAL_CASES:  # most words of prose: nothing to split
            tokens.append(chunk)
            continue
        pieces = _CHUNK_TOKENS.get(chunk)
        if pieces is None:
            if len(_CHUNK_TOKENS) >= MAX_CACHED_CHUNKS:
                _CHUNK_TOKENS.clear()
            split: list[str] = []
            _split_chunk(chunk, split)
            pieces = _CHUNK_TOKENS[chunk] = tuple(split)
        tokens.extend(pieces)
    return tokens


MAX_CACHED_CHUNKS = 100_000
"""Chunks whose split is remembered (~10 MB): text repeats its punctuated words ("it's", "(see", "2024-01-02,")."""
_CHUNK_TOKENS: dict[str, tuple[str, ...]] = {}


def count_sentences(words: list[str]) -> int:
    """Sentences in a line of ``words`` as spaCy's sentencizer cuts them: a new one starts at the first word that
    is not punctuation after a sentence-ending mark (``.``, ``!``, ``?``, ...). 0 for no words."""
    num_sentences = 1 if words else 0
    seen_end = False
    for word in words:
        if word in SENTENCE_END_CHARS:
            seen_end = True
        elif seen_end and not _is_punctuation(word):
            num_sentences += 1
            seen_end = False
    return num_sentences


_PUNCTUATION_WORD = re.compile(r"[^\w\s$£€¥+<=>^`|~]+\Z")


def _is_punctuation(word: str) -> bool:
    """spaCy's ``is_punct``: every character a Unicode punctuation mark (approximated: not a letter, digit,
    symbol or space)."""
    return _PUNCTUATION_WORD.match(word) is not None
