"""Encode step of the data path: document texts -> token id arrays, on every core (HF ``tokenizers`` threads).

Long texts are cut into pieces at points where the byte-level pre-tokenizer would split anyway, so the ids
are identical to encoding the whole text, while the work spreads over all cores and memory stays bounded
(``tokenizers`` holds ~100 bytes per character of a text while encoding it: a 30 MB text needs ~3.5 GB).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from tokenizers import Tokenizer, normalizers, pre_tokenizers

PIECE_CHARS = 1 << 18
"""Texts longer than this (characters) are encoded in pieces of at least this size."""

ENCODE_GROUP_CHARS = 1 << 23
"""At most about this many characters go into one ``encode_batch_fast`` call (bounds peak memory)."""

# A safe cut point ends right after a non-space character that is followed either by "\n" + non-space
# (cut after the newline) or by " " + non-space (cut before the space). At both points the byte-level regex
# ('s|'t|…| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+) ends one pre-token and starts the next, and
# NFC cannot compose across them, so encoding the pieces gives exactly the ids of the whole text.
_CUT = re.compile(r"\S(?:\n(?=\S)|(?= \S))")


def encode_texts(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Encode each text without special tokens; returns one uint32 id array per text, in order.

    Literal special-token strings inside a text (e.g. ``<|endoftext|>``) are encoded as plain text, never
    as the special id: documents are data, and a stray EOS would break document boundaries. This sets
    ``tokenizer.encode_special_tokens`` (a runtime flag, not saved in ``tokenizer.json``).
    """
    tokenizer.encode_special_tokens = True
    piece_chars = PIECE_CHARS if can_split_texts(tokenizer) else None
    pieces: list[str] = []
    num_pieces: list[int] = []
    for text in texts:
        parts = split_text(text, piece_chars) if piece_chars and len(text) > piece_chars else [text]
        pieces.extend(parts)
        num_pieces.append(len(parts))
    piece_ids = list(_encode_pieces(tokenizer, pieces))
    return _join_pieces(piece_ids, num_pieces)


def can_split_texts(tokenizer: Tokenizer) -> bool:
    """True when cutting a text at :data:`_CUT` points cannot change its ids under this tokenizer.

    That holds for tokenmill's recipe (NFC or no normalizer, ByteLevel pre-tokenizer with the GPT-2 regex
    and no prefix space) when no added token contains whitespace; a given tokenizer of another kind is
    encoded whole.
    """
    pre_tokenizer = tokenizer.pre_tokenizer
    if not isinstance(pre_tokenizer, pre_tokenizers.ByteLevel):
        return False
    if pre_tokenizer.add_prefix_space or not pre_tokenizer.use_regex:
        return False
    if tokenizer.normalizer is not None and not isinstance(tokenizer.normalizer, normalizers.NFC):
        return False
    added = tokenizer.get_added_tokens_decoder().values()
    return not any(re.search(r"\s", token.content) for token in added)


def split_text(text: str, piece_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at least ``piece_chars`` characters at safe cut points (linear time).

    A stretch with no safe point (e.g. one huge whitespace-free line) stays in one piece.
    """
    pieces = []
    start = 0
    while len(text) - start > piece_chars:
        match = _CUT.search(text, start + piece_chars)
        if match is None:
            break
        pieces.append(text[start:match.end()])
        start = match.end()
    pieces.append(text[start:])
    return pieces


def _encode_pieces(tokenizer: Tokenizer, pieces: list[str]) -> Iterator[np.ndarray]:
    """Encode pieces in groups of about ENCODE_GROUP_CHARS characters, converting each group to numpy."""
    group: list[str] = []
    group_chars = 0
    for piece in pieces:
        if group and group_chars + len(piece) > ENCODE_GROUP_CHARS:
            yield from _encode_group(tokenizer, group)
            group, group_chars = [], 0
        group.append(piece)
        group_chars += len(piece)
    if group:
        yield from _encode_group(tokenizer, group)


def _encode_group(tokenizer: Tokenizer, group: list[str]) -> Iterator[np.ndarray]:
    # encode_batch_fast skips offset tracking (same ids as encode_batch) and runs on all Rust threads.
    for encoding in tokenizer.encode_batch_fast(group, add_special_tokens=False):
        yield np.array(encoding.ids, dtype=np.uint32)


def _join_pieces(piece_ids: list[np.ndarray], num_pieces: list[int]) -> list[np.ndarray]:
    joined = []
    position = 0
    for count in num_pieces:
        chunk = piece_ids[position:position + count]
        joined.append(chunk[0] if count == 1 else np.concatenate(chunk))
        position += count
    return joined
