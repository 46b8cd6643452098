"""Pack step of the data path: per-document token arrays -> fixed-length rows with lineage (pure, no I/O).

Documents are concatenated, each followed by EOS (and preceded by BOS when the tokenizer adds one), and cut
into rows of ``seq_len`` tokens; a document may span rows. Each row records which documents fill it and where
each begins, so a reader can rebuild document boundaries (attention masks, lineage queries) without the tokenizer.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from core.errors import ConfigError
from core.shards.store import ShardRows


class Packer:
    """Stream documents in with :meth:`add`; take full rows out with :meth:`take_rows`, the rest with :meth:`finish`.

    Cost is linear in tokens: pending tokens are kept as a queue of array views (a long document is sliced,
    never copied again per row), and row lineage is computed with numpy over all rows of a take at once.
    """

    def __init__(self, seq_len: int, eos_id: int, pad_id: int, dtype: np.dtype, bos_id: int | None = None) -> None:
        """``bos_id``: put before each document (a model tokenizer that starts texts with BOS); None = none."""
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.dtype = np.dtype(dtype)
        self._eos = np.array([eos_id], dtype=self.dtype)
        self._bos = None if bos_id is None else np.array([bos_id], dtype=self.dtype)
        self._max_id = int(np.iinfo(self.dtype).max)
        self._pieces: deque[np.ndarray] = deque()
        self._num_pending = 0  # tokens added but not yet emitted
        self._position = 0  # stream position of the first pending token
        self._doc_ids: list[int] = []  # documents with pending tokens, in stream order
        self._doc_starts: list[int] = []  # their stream positions (the first may be before _position)

    @property
    def num_full_rows(self) -> int:
        """Full rows that :meth:`take_rows` can return now."""
        return self._num_pending // self.seq_len

    @property
    def num_pending_tokens(self) -> int:
        """Tokens added (BOS/EOS included) and not yet returned in a row."""
        return self._num_pending

    @property
    def num_added_tokens(self) -> int:
        """Tokens added so far (BOS/EOS included), returned in rows or not."""
        return self._position + self._num_pending

    def add(self, doc_id: int, tokens: np.ndarray) -> None:
        """Append one document's ids followed by EOS (after BOS, if any: its start is the BOS); ConfigError when an
        id does not fit the row dtype."""
        tokens = self._as_row_dtype(np.asarray(tokens))
        self._doc_ids.append(int(doc_id))
        self._doc_starts.append(self._position + self._num_pending)
        if self._bos is not None:
            self._pieces.append(self._bos)
        if tokens.size:
            self._pieces.append(tokens)
        self._pieces.append(self._eos)
        self._num_pending += int(tokens.size) + 1 + (self._bos is not None)

    def take_rows(self, max_rows: int) -> ShardRows | None:
        """Up to ``max_rows`` full rows (oldest first), or None when not one full row is pending."""
        num_rows = min(max_rows, self.num_full_rows)
        if num_rows <= 0:
            return None
        return self._emit(num_rows, num_rows * self.seq_len)

    def finish(self) -> ShardRows | None:
        """Every pending token as rows; the last row is padded with ``pad_id`` (``num_tokens`` = real tokens)."""
        if not self._num_pending:
            return None
        num_rows = -(-self._num_pending // self.seq_len)
        return self._emit(num_rows, self._num_pending)

    def _as_row_dtype(self, tokens: np.ndarray) -> np.ndarray:
        if tokens.dtype == self.dtype or not tokens.size:
            return tokens.astype(self.dtype, copy=False).reshape(-1)
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high > self._max_id:
            raise ConfigError(
                f"token id {high if high > self._max_id else low} does not fit {self.dtype.name} rows; "
                "the tokenizer's vocab is larger than the packing dtype allows (use token_dtype_for_vocab)."
            )
        return tokens.astype(self.dtype).reshape(-1)

    def _emit(self, num_rows: int, num_real: int) -> ShardRows:
        """Turn the next ``num_real`` pending tokens into ``num_rows`` rows and forget them."""
        flat = self._pop_tokens(num_real)
        input_ids = np.full(num_rows * self.seq_len, self.pad_id, dtype=self.dtype)
        input_ids[:num_real] = flat
        rows = self._row_lineage(input_ids.reshape(num_rows, self.seq_len), num_real)
        self._forget_emitted_docs(self._position + num_real)
        self._position += num_real
        self._num_pending -= num_real
        return rows

    def _pop_tokens(self, count: int) -> np.ndarray:
        taken = []
        needed = count
        while needed:
            piece = self._pieces.popleft()
            if piece.size > needed:
                self._pieces.appendleft(piece[needed:])  # a view: the rest of a long document is not copied
                piece = piece[:needed]
            taken.append(piece)
            needed -= piece.size
        return np.concatenate(taken) if len(taken) != 1 else taken[0]

    def _row_lineage(self, input_ids: np.ndarray, num_real: int) -> ShardRows:
        """Lineage of rows covering stream positions [_position, _position + num_real), vectorised."""
        num_rows, seq_len = input_ids.shape
        num_docs = bisect.bisect_left(self._doc_starts, self._position + num_real)
        starts = np.array(self._doc_starts[:num_docs], dtype=np.int64) - self._position
        ids = np.array(self._doc_ids[:num_docs], dtype=np.int64)
        row_starts = np.arange(num_rows, dtype=np.int64) * seq_len
        row_ends = np.minimum(row_starts + seq_len, num_real)
        first = np.searchsorted(starts, row_starts, side="right") - 1  # the doc covering each row's first token
        last = np.searchsorted(starts, row_ends, side="left") - 1  # the last doc starting before the row ends
        counts = last - first + 1
        pair_row = np.repeat(np.arange(num_rows), counts)
        pair_doc = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - first, counts)
        pair_start = np.maximum(starts[pair_doc] - row_starts[pair_row], 0)
        bounds = np.cumsum(counts).tolist()
        return ShardRows(
            input_ids=input_ids,
            doc_ids=_split_list(ids[pair_doc].tolist(), bounds),
            doc_starts=_split_list(pair_start.tolist(), bounds),
            first_doc_offset=(row_starts - starts[first]).tolist(),
            num_tokens=(row_ends - row_starts).tolist(),
        )

    def _forget_emitted_docs(self, end: int) -> None:
        """Drop documents whose every token (BOS/EOS included) lies before stream position ``end``."""
        num_started = bisect.bisect_left(self._doc_starts, end)
        if not num_started:
            return
        # The last started document ends where the next one starts (or where the pending stream ends).
        has_next = num_started < len(self._doc_starts)
        last_end = self._doc_starts[num_started] if has_next else self._position + self._num_pending
        finished = num_started if last_end <= end else num_started - 1
        del self._doc_ids[:finished]
        del self._doc_starts[:finished]


def _split_list(values: list[int], bounds: list[int]) -> list[list[int]]:
    """Cut a flat list at the cumulative ``bounds`` (one sub-list per row)."""
    return [values[start:end] for start, end in zip([0, *bounds[:-1]], bounds, strict=True)]
