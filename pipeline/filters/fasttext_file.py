"""Checking a fastText model file (``.bin``/``.ftz``) before fastText's own loader reads it: path -> its labels.

Why: fastText's loader (``fasttext.load_model``, C++) checks only the magic number and version. A file that
starts like a model but is cut short or damaged sends it into an endless read loop that grows its memory by
gigabytes (measured: fasttext-predict 0.9.2.4 on the first 4,000 bytes of a real model, still reading after
20 s at 2 GB). So every field is walked here, with the layout of fastText 0.9's ``FastText::saveModel``, and
every length is checked against the bytes left, before the loader sees the file. Nothing is executed or
unpickled: the file is read as numbers and strings only.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 793712314
"""``FASTTEXT_FILEFORMAT_MAGIC_INT32``: the first 4 bytes of every fastText model."""
MAX_VERSION = 12
"""``FASTTEXT_VERSION`` of fastText 0.9 (versions 11 and 12 share this layout)."""
SUPERVISED_MODEL = 3
"""``model_name::sup`` in the file's arguments (1 is cbow, 2 skipgram: word vectors, not a classifier)."""
LABEL_ENTRY = 1
"""``entry_type::label`` of a dictionary entry (0 is a word)."""
NUM_CENTROIDS = 256
"""``ProductQuantizer::ksub_``: centroids per sub-quantizer of a quantized (``.ftz``) matrix."""
NUM_INT_ARGS = 12
"""``Args::save``: dim, ws, epoch, minCount, neg, wordNgrams, loss, model, bucket, minn, maxn, lrUpdateRate."""


class NotAFastTextModel(ValueError):
    """The file is not a complete fastText model; the message says what is wrong, without the path."""


@dataclass(frozen=True)
class FastTextModelInfo:
    """What the header of a fastText model says."""

    is_classifier: bool
    """Whether it is a supervised model (a classifier), not word vectors."""
    labels: tuple[str, ...]
    """Its labels as written, ``__label__`` prefix included."""
    num_words: int
    """Words in its vocabulary."""
    dim: int
    """Dimension of its word vectors."""


class _Reader:
    """Little-endian fields of a memory-mapped file; every read checked against the bytes left."""

    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data, self.offset = data, 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise NotAFastTextModel(f"cut short at byte {self.offset} of {len(self.data)}")
        values = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += size
        return values

    def skip(self, num_bytes: int, what: str) -> None:
        if num_bytes < 0 or self.offset + num_bytes > len(self.data):
            raise NotAFastTextModel(f"{what} needs {num_bytes} bytes at byte {self.offset}, but the file has "
                                    f"{len(self.data) - self.offset} left")
        self.offset += num_bytes

    def string(self) -> str:
        end = self.data.find(b"\0", self.offset)
        if end < 0:
            raise NotAFastTextModel(f"a dictionary word at byte {self.offset} runs to the end of the file")
        word = bytes(self.data[self.offset:end]).decode("utf-8", "replace")
        self.offset = end + 1
        return word


def read_model_info(path: Path) -> FastTextModelInfo:
    """Walk the whole file at ``path``; raise :class:`NotAFastTextModel` unless it is a complete fastText model.

    Reads the dictionary's words (a few ms per 100,000) and skips the matrices by their sizes; ``OSError``
    when the file cannot be opened.
    """
    with path.open("rb") as file:
        if path.stat().st_size == 0:
            raise NotAFastTextModel("the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(_Reader(data))


def _walk(reader: _Reader) -> FastTextModelInfo:
    magic, version = reader.take("<ii")
    if magic != MAGIC:
        raise NotAFastTextModel("it does not start with fastText's magic number")
    if not 11 <= version <= MAX_VERSION:
        raise NotAFastTextModel(f"fastText file version {version}; this loader reads 11..{MAX_VERSION}")
    args = reader.take(f"<{NUM_INT_ARGS}i")
    reader.take("<d")  # t, the sampling threshold
    dim, model = args[0], args[7]
    if dim <= 0:
        raise NotAFastTextModel(f"dimension {dim}")
    labels, num_words = _walk_dictionary(reader)
    (quantized_input,) = reader.take("<?")
    _walk_matrix(reader, quantized_input, "the input matrix")
    (quantized_output,) = reader.take("<?")
    _walk_matrix(reader, quantized_input and quantized_output, "the output matrix")
    if reader.offset != len(reader.data):
        raise NotAFastTextModel(f"{len(reader.data) - reader.offset} bytes after the end of the model")
    return FastTextModelInfo(model == SUPERVISED_MODEL, labels, num_words, dim)


def _walk_dictionary(reader: _Reader) -> tuple[tuple[str, ...], int]:
    size, num_words, num_labels, _num_tokens, prune_size = reader.take("<iiiqq")
    if size < 0 or num_words < 0 or num_labels < 0 or num_words + num_labels != size:
        raise NotAFastTextModel(f"a dictionary of {size} entries that says {num_words} words and {num_labels} labels")
    labels = []
    for _ in range(size):
        word = reader.string()
        _count, entry_type = reader.take("<qb")
        if entry_type == LABEL_ENTRY:
            labels.append(word)
    reader.skip(8 * max(prune_size, 0), "the pruned-word index")  # -1: never pruned
    return tuple(labels), num_words


def _walk_matrix(reader: _Reader, quantized: bool, what: str) -> None:
    if not quantized:
        rows, cols = reader.take("<qq")
        if rows < 0 or cols < 0:
            raise NotAFastTextModel(f"{what} is {rows} x {cols}")
        reader.skip(4 * rows * cols, what)
        return
    has_norms, rows, _cols, code_size = reader.take("<?qqi")
    reader.skip(code_size, f"{what}'s codes")
    _walk_quantizer(reader, what)
    if has_norms:
        reader.skip(rows, f"{what}'s norm codes")
        _walk_quantizer(reader, what)


def _walk_quantizer(reader: _Reader, what: str) -> None:
    dim, _num_subquantizers, _sub_dim, _last_sub_dim = reader.take("<iiii")
    reader.skip(4 * dim * NUM_CENTROIDS if dim >= 0 else -1, f"{what}'s centroids")
