"""pipeline/dedupe/kernels.py against plain-Python references, on real stdlib text and on generated edge cases."""

from __future__ import annotations

import random
import unicodedata

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from pipeline.dedupe import kernels, minhash
from pipeline.filters.screen import COMPILED_COLLAPSE_MIN_CHARS, content_hash

MASK = 2**64 - 1
UNICODE_WHITESPACE = [chr(code) for code in range(0x110000) if chr(code).isspace()]
"""Every character str.split() splits on (29 in Python 3.11's Unicode data)."""


def fmix64(value: int) -> int:
    value ^= value >> 33
    value = value * 0xFF51AFD7ED558CCD & MASK
    value ^= value >> 33
    value = value * 0xC4CEB9FE1A85EC53 & MASK
    return value ^ (value >> 33)


def fnv1a_words(words: list[bytes]) -> list[int]:
    """FNV-1a 64 of each word's bytes, then MurmurHash3's finaliser."""
    hashes = []
    for word in words:
        state = 0xCBF29CE484222325
        for byte in word:
            state = (state ^ byte) * 0x100000001B3 & MASK
        hashes.append(fmix64(state))
    return hashes


def reference_normalised_words(text: str) -> list[str]:
    """Character by character: case-folded; punctuation, symbols, controls and whitespace end a word; digits are 0."""
    words, word = [], []
    for character in text.casefold():
        category = unicodedata.category(character)
        if category[0] in "PS" or category == "Cc" or character.isspace():
            if word:
                words.append("".join(word))
            word = []
        else:
            word.append("0" if category == "Nd" else character)
    return [*words, "".join(word)] if word else words


def reference_word_hashes(text: str) -> list[int]:
    return fnv1a_words([word.encode("utf-8") for word in reference_normalised_words(text)])


def reference_whitespace_word_hashes(text: str) -> list[int]:
    return fnv1a_words(text.encode("utf-8").lower().split())


def reference_shingles(words: list[int], ngram: int) -> list[int]:
    multipliers = [int(value) for value in minhash._POSITION_MULTIPLIERS]
    if len(words) < ngram:
        return [fmix64((len(words) + sum(w * m for w, m in zip(words, multipliers, strict=False))) & MASK)]
    return [fmix64((ngram + sum(words[start + k] * multipliers[k] for k in range(ngram))) & MASK)
            for start in range(len(words) - ngram + 1)]


def random_texts(count: int, seed: int) -> list[str]:
    """Short texts mixing ASCII, accented and astral characters and every kind of whitespace."""
    rng = random.Random(seed)
    alphabet = [*UNICODE_WHITESPACE, *"abcXYZ09_(", "\u00e9", "\u00c9", "\u20ac", "\U0001f600", "\u200b", "\u2028x"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def stdlib_sample() -> list[str]:
    import json
    import pathlib

    root = pathlib.Path(json.__file__).parent.parent
    return [path.read_text(encoding="utf-8") for path in sorted(root.glob("*.py"))[:40]]


EDGE_CASES = ["", "   ", "one", "Two WORDS", "\x00nul\x00 byte", "don't \u201cquote\u201d",
              "\u00c9T\u00c9 \u00e9t\u00e9!", "\u0130stanbul STRASSE Stra\u00dfe",
              "2024-05-01 \u0663\u0664 \uff11\uff12",
              "a\u00a0b\u3000c\u2028d", "x_y\u00a9z \u20ac5 \U0001f600ok", "\u4e2d\u6587\u3002\u6587\u5b57\uff0c",
              "\u0928\u092e\u0938\u094d\u0924\u0947"]


def test_word_hashes_match_the_reference(stdlib_sample: list[str]) -> None:
    texts = stdlib_sample + random_texts(300, seed=1) + EDGE_CASES
    hashes, offsets = minhash.word_hashes(pa.array(texts, pa.large_string()))
    assert offsets.dtype == np.int64 and len(offsets) == len(texts) + 1
    for index, text in enumerate(texts):
        assert hashes[offsets[index] : offsets[index + 1]].tolist() == reference_word_hashes(text), repr(text[:60])


def test_copies_differing_in_punctuation_case_and_spacing_have_the_same_words() -> None:
    variants = ["It's 10:30, \"Mr. Smith\" said -- don't wait!",
                "it\u2019s 10.30 \u201cmr smith\u201d said\u2014don\u2019t wait",
                "IT'S 99:99 MR.SMITH SAID (DON'T) WAIT...", "it s 10 30 mr smith said don t wait"]
    hashes, offsets = minhash.word_hashes(pa.array(variants))
    words = [hashes[offsets[i] : offsets[i + 1]].tolist() for i in range(len(variants))]
    assert all(own == words[-1] for own in words) and len(words[-1]) == 10


def test_invalid_utf8_binary_input_stays_inside_its_text() -> None:
    """Binary input is not checked UTF-8: cut-off and over-long sequences read nothing past their text."""
    raw = [b"ok \xf0\x9f", b"\xff\xfe\xfd word", b"\xe2", b"caf\xc3\xa9 \xf8\x88\x80\x80\x80 x"]
    hashes, offsets = minhash.word_hashes(pa.array(raw, pa.binary()))
    assert len(offsets) == len(raw) + 1 and offsets[-1] == len(hashes)
    again, _ = minhash.word_hashes(pa.array(raw, pa.large_binary()))
    assert np.array_equal(hashes, again)
    assert hashes[offsets[3]] == reference_word_hashes("café")[0]


def test_whitespace_word_hashes_match_the_reference(stdlib_sample: list[str]) -> None:
    texts = stdlib_sample[:10] + random_texts(100, seed=1) + EDGE_CASES
    hashes, offsets = minhash.whitespace_word_hashes(pa.array(texts, pa.large_string()))
    for index, text in enumerate(texts):
        expected = reference_whitespace_word_hashes(text)
        assert hashes[offsets[index] : offsets[index + 1]].tolist() == expected, repr(text[:60])


@pytest.mark.parametrize("ngram", [1, 3, 5, 13])
def test_shingle_hashes_match_the_reference(stdlib_sample: list[str], ngram: int) -> None:
    texts = [*stdlib_sample[:10], "", "a", "a b", "a b c d", "a b c d e", "a b c d e f"]
    words, word_offsets = minhash.word_hashes(pa.array(texts))
    shingles, offsets = minhash.shingle_hashes(words, word_offsets, ngram)
    for index, text in enumerate(texts):
        expected = reference_shingles(reference_word_hashes(text), ngram)
        assert shingles[offsets[index] : offsets[index + 1]].tolist() == expected


def test_every_arrow_layout_gives_the_same_words(stdlib_sample: list[str]) -> None:
    texts = stdlib_sample[:6]
    expected = minhash.word_hashes(pa.array(texts, pa.large_string()))
    layouts = [pa.array(texts, pa.string()),  # int32 offsets
               pa.array(["skip me", *texts], pa.large_string()).slice(1),  # a slice: offsets do not start at 0
               pa.chunked_array([pa.array(texts[:2]), pa.array(texts[2:], pa.string())]),
               pa.chunked_array([pa.array(texts, pa.large_string())])]
    for layout in layouts:
        hashes, offsets = minhash.word_hashes(layout)
        assert np.array_equal(hashes, expected[0]) and np.array_equal(offsets, expected[1])
    empty_hashes, empty_offsets = minhash.word_hashes(pa.array([], pa.large_string()))
    assert len(empty_hashes) == 0 and empty_offsets.tolist() == [0]


def test_the_densest_text_fits_the_word_buffer() -> None:
    """One-byte texts and 'a b a b ...' are the most words per byte the preallocated buffer must hold."""
    texts = ["a"] * 5000 + ["a b " * 2000 + "a"] + ["x"] * 3
    hashes, offsets = minhash.word_hashes(pa.array(texts))
    assert len(hashes) == 5000 + 4001 + 3 and offsets[-1] == len(hashes)


def test_collapse_is_str_split_join_for_every_whitespace(stdlib_sample: list[str]) -> None:
    texts = stdlib_sample + random_texts(3000, seed=2) + [ws for ws in UNICODE_WHITESPACE] + [
        "\u2028", "a\u3000\u3000b", "x\xa0", "\u0085y", "tail \xe2"[:-1] + "\u2003"]
    for text in texts:
        assert bytes(kernels.collapse_whitespace(text.encode("utf-8"))) == " ".join(text.split()).encode("utf-8")


def test_collapse_keeps_truncated_and_lookalike_sequences() -> None:
    """Bytes that only start like a multi-byte space (U+2030, U+3001, a cut-off NBSP) are text, not space."""
    for raw in [b"a\xe2\x80\xb0b", b"a\xe3\x80\x81b", b"a \xc2", b"\xe2\x80", b"\xc2\xa1 x"]:
        assert bytes(kernels.collapse_whitespace(raw)) == raw


def test_content_hash_is_the_same_on_both_paths(stdlib_sample: list[str]) -> None:
    long_texts = [text for text in stdlib_sample if len(text) >= COMPILED_COLLAPSE_MIN_CHARS]
    assert long_texts
    for text in long_texts + random_texts(50, seed=3):
        assert content_hash(text) == xxhash.xxh3_128_hexdigest(" ".join(text.split()).encode("utf-8"))


def test_sorted_set_jaccard_matches_python_sets() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        first = np.unique(rng.integers(0, 60, rng.integers(0, 40))).astype(np.uint32)
        second = np.unique(rng.integers(0, 60, rng.integers(0, 40))).astype(np.uint32)
        union = set(first.tolist()) | set(second.tolist())
        expected = len(set(first.tolist()) & set(second.tolist())) / len(union) if union else 1.0
        assert kernels.sorted_set_jaccard(first, second) == pytest.approx(expected)


def test_shingle_hashes_refuse_offsets_outside_the_words() -> None:
    """The compiled loop does not check bounds, so its wrapper does."""
    words = np.arange(5, dtype=np.uint64)
    for offsets in ([0, 6], [1, 0, 5], [-1, 5], []):
        with pytest.raises(ValueError, match="word_offsets"):
            minhash.shingle_hashes(words, np.array(offsets, dtype=np.int64), 2)
