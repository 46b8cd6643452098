"""Compiled one-pass loops over UTF-8 bytes for the dedupe stage: words, shingles and collapsed whitespace.

These loops touch every byte of the corpus, and vectorised alternatives pay for it in intermediate
objects: Arrow's split + flatten + dictionary encoding followed by a Python hash per distinct word ran
at ~130 MB/s on the stdlib, these numba loops at ~410 MB/s (words + shingles) on one core, and the
whitespace collapse of the exact-dedupe key at ~580 MB/s against ~210 MB/s for ``" ".join(text.split())``.
numba compiles them on first use (a few seconds) and caches the machine code beside this file.

numba does not check bounds: every loop only reads ``data[offsets[i]:offsets[i + 1]]``, so the wrappers
here build ``offsets`` from the Arrow array itself and the loops are never exposed with other inputs.
"""

from __future__ import annotations

import functools
import unicodedata

import numpy as np
import pyarrow as pa
from numba import njit

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
_MIX_1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX_2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)

ASCII_WHITESPACE = np.zeros(256, dtype=np.bool_)
ASCII_WHITESPACE[list(b" \t\n\v\f\r")] = True
"""The bytes ``bytes.split()`` splits on: words for MinHash are ASCII-whitespace separated."""
ASCII_LOWER = np.arange(256, dtype=np.uint64)
ASCII_LOWER[ord("A") : ord("Z") + 1] += 32
"""``bytes.lower()``: only A-Z change; other bytes (and so every non-ASCII character) stay as they are."""
ASCII_SEPARATORS = np.zeros(256, dtype=np.bool_)
ASCII_SEPARATORS[[byte for byte in range(128) if not chr(byte).isalnum()]] = True
"""ASCII bytes that end a normalised word: whitespace, controls, punctuation and symbols (``_`` included, it is
Unicode punctuation); only letters and digits are word bytes. Other characters: :func:`code_point_tables`."""
ASCII_NORMALISED = ASCII_LOWER.copy()
ASCII_NORMALISED[ord("0") : ord("9") + 1] = ord("0")
"""Lower-case A-Z and every digit as ``0`` (the byte map of normalised words)."""


@functools.cache
def str_whitespace_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``str.split()`` splits on, as UTF-8 byte tables for :func:`collapse_whitespace` (built on first use:
    scanning every code point takes ~50 ms).

    Returns (one-byte whitespace by byte value, lead bytes of multi-byte whitespace, the multi-byte ones —
    NEL, NBSP, U+2000-U+200A, U+3000, ... — as sorted big-endian integers of their UTF-8 bytes).
    """
    encoded = [chr(code).encode("utf-8") for code in range(0x110000)
               if not 0xD800 <= code <= 0xDFFF and chr(code).isspace()]
    single = np.zeros(256, dtype=np.bool_)
    single[[seq[0] for seq in encoded if len(seq) == 1]] = True
    leads = np.zeros(256, dtype=np.bool_)
    leads[[seq[0] for seq in encoded if len(seq) > 1]] = True
    long_keys = np.array(sorted(int.from_bytes(seq, "big") for seq in encoded if len(seq) > 1), dtype=np.uint32)
    return single, leads, long_keys


@njit(inline="always")
def _fmix64(value: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finaliser (the same as pipeline.dedupe.minhash's numpy one)."""
    value ^= value >> _SHIFT
    value *= _MIX_1
    value ^= value >> _SHIFT
    value *= _MIX_2
    return value ^ (value >> _SHIFT)


@njit(cache=True, nogil=True)
def _word_hashes(data: np.ndarray, offsets: np.ndarray, whitespace: np.ndarray, lower: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    num_docs = len(offsets) - 1
    # a text of L bytes has at most (L + 1) // 2 words (each a byte and a separator but the last)
    hashes = np.empty((offsets[num_docs] - offsets[0] + num_docs) // 2 + 1, dtype=np.uint64)
    word_offsets = np.zeros(num_docs + 1, dtype=np.int64)
    count = 0
    for doc in range(num_docs):
        state = FNV_OFFSET
        in_word = False
        for position in range(offsets[doc], offsets[doc + 1]):
            byte = data[position]
            if whitespace[byte]:
                if in_word:
                    hashes[count] = _fmix64(state)
                    count += 1
                    in_word = False
                    state = FNV_OFFSET
            else:
                state = (state ^ lower[byte]) * FNV_PRIME
                in_word = True
        if in_word:
            hashes[count] = _fmix64(state)
            count += 1
        word_offsets[doc + 1] = count
    return hashes[:count], word_offsets


@njit(cache=True, nogil=True)
def _shingle_hashes(words: np.ndarray, word_offsets: np.ndarray, ngram: int, multipliers: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    num_docs = len(word_offsets) - 1
    shingle_offsets = np.zeros(num_docs + 1, dtype=np.int64)
    for doc in range(num_docs):
        shingle_offsets[doc + 1] = shingle_offsets[doc] + max(word_offsets[doc + 1] - word_offsets[doc] - ngram + 1, 1)
    shingles = np.empty(shingle_offsets[num_docs], dtype=np.uint64)
    for doc in range(num_docs):
        first, stop, out = word_offsets[doc], word_offsets[doc + 1], shingle_offsets[doc]
        if stop - first >= ngram:
            for start in range(first, stop - ngram + 1):
                combined = np.uint64(ngram)
                for position in range(ngram):
                    combined += words[start + position] * multipliers[position]
                shingles[out] = _fmix64(combined)
                out += 1
        else:  # one shingle of all its words (none: the hash of the length 0)
            combined = np.uint64(stop - first)
            for position in range(stop - first):
                combined += words[first + position] * multipliers[position]
            shingles[out] = _fmix64(combined)
    return shingles, shingle_offsets


@njit(cache=True, nogil=True)
def _collapse_whitespace(data: np.ndarray, single: np.ndarray, leads: np.ndarray, long_keys: np.ndarray
                         ) -> np.ndarray:
    # A counted for-loop with a skip counter for the rest of a multi-byte space: 2x a while-loop that
    # steps by character width (578 vs 290 MB/s on the stdlib).
    size = len(data)
    out = np.empty(size, dtype=np.uint8)
    count = 0
    pending_space = False  # a whitespace run seen after a word: written only if another word follows
    skip = 0
    for position in range(size):
        if skip:
            skip -= 1
            continue
        byte = data[position]
        if single[byte]:
            pending_space = count > 0
            continue
        if leads[byte]:
            width = 2 if byte < 0xE0 else 3
            if position + width <= size:
                key = np.uint32(0)
                for offset in range(width):
                    key = (key << np.uint32(8)) | np.uint32(data[position + offset])
                found = False
                for candidate in long_keys:
                    found |= candidate == key
                if found:
                    pending_space = count > 0
                    skip = width - 1
                    continue
        if pending_space:
            out[count] = 32
            count += 1
            pending_space = False
        out[count] = byte
        count += 1
    return out[:count]


@njit(cache=True, nogil=True)
def sorted_set_jaccard(first: np.ndarray, second: np.ndarray) -> float:
    """Jaccard of two sorted arrays of distinct values, by one merge (no temporary arrays)."""
    i = j = common = 0
    while i < len(first) and j < len(second):
        if first[i] == second[j]:
            common += 1
            i += 1
            j += 1
        elif first[i] < second[j]:
            i += 1
        else:
            j += 1
    union = len(first) + len(second) - common
    return common / union if union else 1.0


def utf8_buffers(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy ``(bytes, int64 offsets)`` of a string array; ``bytes[offsets[i]:offsets[i+1]]`` is text i."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
    if pa.types.is_string(texts.type) or pa.types.is_binary(texts.type):
        texts = texts.cast(pa.large_binary())
    if texts.null_count:
        raise ValueError("texts must not contain nulls")
    _, offsets_buffer, data_buffer = texts.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[texts.offset : texts.offset + len(texts) + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, dtype=np.uint8)
    if len(offsets) == 0:  # an empty array may have no offsets buffer contents
        offsets = np.zeros(1, dtype=np.int64)
    return data, offsets


def whitespace_word_hashes(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The words of ``text.encode().lower().split()`` per text as uint64 hashes (FNV-1a, MurmurHash3-finalised),
    flat, with int64 per-text offsets."""
    data, offsets = utf8_buffers(texts)
    return _word_hashes(data, offsets, ASCII_WHITESPACE, ASCII_LOWER)


SEPARATOR_CODE = np.uint32(0xFFFFFFFF)
"""In :func:`code_point_tables`: the code point ends a word."""
MULTI_CODE = np.uint32(0x80000000)
"""In :func:`code_point_tables`: flag of an index into the table of multi-character case folds."""


@functools.cache
def code_point_tables() -> tuple[np.ndarray, np.ndarray]:
    """What each code point becomes in a normalised word: ``(map, folds)``.

    ``map[c]`` (uint32 per code point) is :data:`SEPARATOR_CODE` for punctuation (P*), symbols (S*), controls
    (Cc) and whitespace, ``0`` for decimal digits (Nd), else the one code point ``chr(c).casefold()`` gives; for
    the ~100 that case-fold to several (``ß`` -> ``ss``) it is ``MULTI_CODE | i`` and ``folds[i]`` holds the count
    and up to three mapped code points. Built on first use (~1 s; ingest's fork server builds it once for its
    workers), 4.5 MB.
    """
    def mapped(character: str) -> int:
        category = unicodedata.category(character)
        if category[0] in "PS" or category == "Cc" or character.isspace():
            return int(SEPARATOR_CODE)
        return ord("0") if category == "Nd" else ord(character)

    table = np.empty(0x110000, dtype=np.uint32)
    folds: list[list[int]] = []
    for code in range(0x110000):
        folded = chr(code).casefold() if not 0xD800 <= code <= 0xDFFF else chr(code)
        if len(folded) == 1:
            table[code] = mapped(folded)
        else:
            table[code] = int(MULTI_CODE) | len(folds)
            folds.append([len(folded), *(mapped(character) for character in folded)])
    width = max(len(row) for row in folds)
    return table, np.array([row + [0] * (width - len(row)) for row in folds], dtype=np.uint32)


@njit(inline="always")
def _hash_code_point(state: np.uint64, code: np.uint32) -> np.uint64:
    """FNV-1a over the UTF-8 bytes of one code point."""
    if code < 0x80:
        return (state ^ np.uint64(code)) * FNV_PRIME
    if code < 0x800:
        state = (state ^ np.uint64(0xC0 | (code >> 6))) * FNV_PRIME
    else:
        if code < 0x10000:
            state = (state ^ np.uint64(0xE0 | (code >> 12))) * FNV_PRIME
        else:
            state = (state ^ np.uint64(0xF0 | (code >> 18))) * FNV_PRIME
            state = (state ^ np.uint64(0x80 | ((code >> 12) & 0x3F))) * FNV_PRIME
        state = (state ^ np.uint64(0x80 | ((code >> 6) & 0x3F))) * FNV_PRIME
    return (state ^ np.uint64(0x80 | (code & 0x3F))) * FNV_PRIME


@njit(cache=True, nogil=True)
def _normalised_word_hashes(data: np.ndarray, offsets: np.ndarray, separators: np.ndarray, byte_map: np.ndarray,
                            code_map: np.ndarray, folds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # ASCII bytes go through the byte tables as in _word_hashes; a multi-byte character is decoded and mapped
    # through code_map (and folds). Arrow strings are valid UTF-8; binary input may not be, so a sequence never
    # reads past its text and a decoded value past U+10FFFF never indexes code_map.
    num_docs = len(offsets) - 1
    hashes = np.empty((offsets[num_docs] - offsets[0] + num_docs) // 2 + 1, dtype=np.uint64)
    word_offsets = np.zeros(num_docs + 1, dtype=np.int64)
    count = 0
    for doc in range(num_docs):
        state = FNV_OFFSET
        in_word = False
        skip = 0
        stop = offsets[doc + 1]
        for position in range(offsets[doc], stop):
            if skip:
                skip -= 1
                continue
            byte = data[position]
            if byte < 0x80:
                if separators[byte]:
                    if in_word:
                        hashes[count] = _fmix64(state)
                        count += 1
                        in_word = False
                        state = FNV_OFFSET
                else:
                    state = (state ^ byte_map[byte]) * FNV_PRIME
                    in_word = True
                continue
            if byte < 0xE0:
                skip = 1
                code = np.uint32(byte & 0x1F)
            elif byte < 0xF0:
                skip = 2
                code = np.uint32(byte & 0x0F)
            else:
                skip = 3
                code = np.uint32(byte & 0x07)
            skip = min(skip, stop - position - 1)  # a sequence cut off by the text's end (invalid UTF-8)
            for offset in range(1, skip + 1):
                code = (code << np.uint32(6)) | np.uint32(data[position + offset] & 0x3F)
            if code >= 0x110000:  # only from invalid UTF-8 (binary input): the replacement character
                code = np.uint32(0xFFFD)
            target = code_map[code]
            num_mapped = 1
            if target != SEPARATOR_CODE and target & MULTI_CODE:
                row = target & ~MULTI_CODE
                num_mapped = folds[row, 0]
            for item in range(num_mapped):
                if num_mapped > 1:
                    target = folds[row, item + 1]
                if target == SEPARATOR_CODE:
                    if in_word:
                        hashes[count] = _fmix64(state)
                        count += 1
                        in_word = False
                        state = FNV_OFFSET
                else:
                    state = _hash_code_point(state, target)
                    in_word = True
        if in_word:
            hashes[count] = _fmix64(state)
            count += 1
        word_offsets[doc + 1] = count
    return hashes[:count], word_offsets


def word_hashes(texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Normalised words per text as uint64 hashes (FNV-1a of their UTF-8, MurmurHash3-finalised), flat, with int64
    per-text offsets: case-folded (``str.casefold``: ``Straße`` and ``STRASSE`` are one word), split on any
    whitespace, punctuation (P*), symbol (S*) or control character, every decimal digit (Nd) read as ``0``.

    One compiled pass: ASCII bytes through 256-entry tables, other characters decoded and mapped through
    :func:`code_point_tables` (built on the first text that has any).
    """
    data, offsets = utf8_buffers(texts)
    if len(data) and int(data.max()) >= 0x80:
        code_map, folds = code_point_tables()
    else:  # never read: an all-ASCII batch need not build the tables
        code_map, folds = np.zeros(1, dtype=np.uint32), np.zeros((1, 4), dtype=np.uint32)
    return _normalised_word_hashes(data, offsets, ASCII_SEPARATORS, ASCII_NORMALISED, code_map, folds)


def shingle_hashes(words: np.ndarray, word_offsets: np.ndarray, ngram: int, multipliers: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every run of ``ngram`` consecutive words per text (``sum(word[i + k] * multipliers[k]) + ngram``,
    finalised), with per-text offsets; a text of fewer words is one shingle of all of them."""
    if not 1 <= ngram <= len(multipliers):
        raise ValueError(f"ngram must be between 1 and {len(multipliers)}, got {ngram}")
    word_offsets = np.ascontiguousarray(word_offsets, dtype=np.int64)
    # The loop does not check bounds: offsets that leave ``words`` would read other memory.
    inside = len(word_offsets) > 0 and word_offsets[0] >= 0 and word_offsets[-1] <= len(words)
    if not inside or np.any(np.diff(word_offsets) < 0):
        raise ValueError("word_offsets must be non-decreasing offsets into words (as word_hashes returns them)")
    return _shingle_hashes(np.ascontiguousarray(words, dtype=np.uint64), word_offsets, ngram, multipliers)


def collapse_whitespace(encoded: bytes | bytearray | memoryview) -> np.ndarray:
    """UTF-8 bytes of ``" ".join(text.split())`` from the UTF-8 bytes of ``text`` (str.split's Unicode whitespace)."""
    return _collapse_whitespace(np.frombuffer(encoded, dtype=np.uint8), *str_whitespace_tables())

