"""Bytes behind tokens: a row's scored token ids -> the UTF-8 bytes they decode to (for bits per byte).

Bits per byte divides a model's summed loss by the bytes of text it predicted, so models with different
tokenizers compare on one scale. The bytes are those of the text the scored tokens decode to, special tokens
(EOS, padding, BOS) contributing none. A row starts and ends at token boundaries, which with a byte-level BPE can
split one multi-byte character between two rows: each half then decodes to U+FFFD (3 bytes) instead of its
1-3 bytes, a difference of a few bytes per row at most, and none for ASCII text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


class ScoredBytes:
    """[rows, seq_len] labels (negative = not scored) -> each row's UTF-8 bytes of the tokens its loss scores."""

    def __init__(self, tokenizer_file: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def __call__(self, labels: np.ndarray) -> np.ndarray:
        """Labels as the loss sees them: position 0 is never predicted, so only ``labels[:, 1:]`` count."""
        scored = [row[row >= 0].tolist() for row in np.asarray(labels)[:, 1:]]
        texts = self.tokenizer.decode_batch(scored, skip_special_tokens=True)
        return np.array([len(text.encode("utf-8")) for text in texts], dtype=np.float64)
