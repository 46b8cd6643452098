"""A model-based quality filter: example files -> a fastText classifier (``model.bin``) -> a score per document.

``tokenmill classifier train POSITIVE NEGATIVE --out model.bin`` trains one (:func:`train_classifier`, with the
``fasttext-new`` package of the ``classifier`` extra); ``filters.quality_classifier`` in a manifest scores every
document with it at ingest (:class:`QualityClassifier`, through ``fasttext-predict``, a main dependency), so a
plain install can use a model trained elsewhere. The same :func:`classifier_text` prepares a document for both.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from core.config import FrozenConfig, Seed
from core.errors import ConfigError
from core.files.atomic import atomic_path, sha256_file
from pipeline.filters.fasttext_file import NotAFastTextModel, read_model_info
from pipeline.filters.normalisation import normalise_text

LABEL_PREFIX = "__label__"
POSITIVE_LABEL, NEGATIVE_LABEL = "positive", "negative"
"""The labels ``tokenmill classifier train`` gives its two example sets (``filters.quality_classifier.label``'s
default is the positive one)."""
SAMPLE_CHARS = 10_000
"""Characters from the start of a normalised document the classifier reads (training and scoring alike): the
cost per document stays flat however long it is."""


class ClassifierTrainingConfig(FrozenConfig):
    """Settings of :func:`train_classifier`; fastText's supervised defaults except where a field says."""

    epoch: int = Field(default=25, ge=1)
    """Passes over the examples (fastText's default is 5; 25 as its tutorial advises for small example sets)."""
    lr: float = Field(default=0.5, gt=0.0)
    """Learning rate (fastText's default 0.1 learns too slowly on a few hundred examples)."""
    dim: int = Field(default=32, ge=1)
    """Dimension of the word vectors."""
    word_ngrams: int = Field(default=2, ge=1)
    """Longest word n-gram used as a feature (2: words and word pairs, as DCLM's quality classifier)."""
    bucket: int = Field(default=100_000, ge=0)
    """Hash buckets of the word pairs: the model is about (words + bucket) × dim × 4 bytes (100,000: ~13 MB)."""
    held_out_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Share of the examples kept out of training to measure accuracy, chosen by content hash."""
    seed: Seed = 0
    """fastText's seed; with one thread, the same examples and seed give the same model file."""
    text_field: str = "text"
    """Field holding the text in JSONL example files."""


@dataclass(frozen=True)
class ClassifierTrainingSummary:
    """What :func:`train_classifier` did; :meth:`line` is what the command prints."""

    out: Path
    num_positive: int
    num_negative: int
    num_held_out: int
    held_out_accuracy: float | None
    """Share of held-out examples whose more likely label is theirs; None when none were held out."""
    train_seconds: float

    def line(self) -> str:
        accuracy = "n/a" if self.held_out_accuracy is None else f"{self.held_out_accuracy:.3f}"
        return (f"wrote {self.out}: {self.num_positive} {POSITIVE_LABEL} and {self.num_negative} {NEGATIVE_LABEL} "
                f"examples, held-out accuracy {accuracy} on {self.num_held_out}, trained in {self.train_seconds:.1f} s")


def classifier_text(text: str) -> str:
    """The one-line form a document is classified in: normalised as ingest does, the first :data:`SAMPLE_CHARS`
    characters, whitespace runs (line ends included: fastText reads one example per line) made one space."""
    return " ".join(normalise_text(text)[:SAMPLE_CHARS].split())


def read_examples(path: Path, text_field: str = "text") -> list[str]:
    """The example documents at ``path``, in :func:`classifier_text` form, empty ones dropped.

    A folder: every file under it, in path order, one document per file (as a ``text`` source), except
    ``*.jsonl`` files, one document per line (``text_field``); a ``*.jsonl`` file: one per line; any other
    file: one per line. Raises :class:`ConfigError` naming the path for a missing path, a bad JSONL line
    or a file that is not UTF-8.
    """
    if not path.exists():
        raise ConfigError(f"{path}: no such file or folder of examples")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    texts: list[str] = []
    for file in files:
        try:
            content = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{file}: not UTF-8 ({err.reason} at byte {err.start}); save it as UTF-8 or "
                              "leave it out") from None
        if file.suffix == ".jsonl":
            texts.extend(_jsonl_texts(file, content, text_field))
        elif path.is_dir():
            texts.append(content)
        else:
            texts.extend(content.splitlines())
    return [sample for sample in map(classifier_text, texts) if sample]


def _jsonl_texts(file: Path, content: str, text_field: str) -> list[str]:
    texts = []
    for line_number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ConfigError(f"{file}:{line_number}: not a JSON object ({err}); one object per line") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ConfigError(f"{file}:{line_number}: no string field {text_field!r}; name the text field with "
                              "--text-field")
        texts.append(record[text_field])
    return texts


def train_classifier(positive: Path, negative: Path, out: Path,
                     config: ClassifierTrainingConfig | None = None) -> ClassifierTrainingSummary:
    """Train a fastText classifier of ``positive`` against ``negative`` examples (:func:`read_examples`) and
    write it to ``out`` atomically; its labels are ``positive`` and ``negative``.

    One thread and a fixed seed, so the same inputs give the same file. Raises :class:`ConfigError` for a
    missing or empty example set, and ImportError naming the extra when fasttext-new is not installed.
    """
    config = config or ClassifierTrainingConfig()
    try:
        import fasttext_new  # the [classifier] extra: only `tokenmill classifier train`
    except ImportError:
        raise ImportError("tokenmill classifier train needs fastText training: pip install 'tokenmill[classifier]'"
                          " (fasttext-new)") from None
    examples = {label: read_examples(path, config.text_field)
                for label, path in ((POSITIVE_LABEL, positive), (NEGATIVE_LABEL, negative))}
    for label, path in ((POSITIVE_LABEL, positive), (NEGATIVE_LABEL, negative)):
        if not examples[label]:
            raise ConfigError(f"{path}: no {label} examples (no non-empty document); give a folder of text files, "
                              "a .jsonl file or a file with one example per line")
    train_rows, held_out = _split_examples(examples, config)
    with tempfile.TemporaryDirectory(prefix="tokenmill-classifier-") as folder:
        train_file = Path(folder) / "train.txt"
        train_file.write_text("".join(f"{LABEL_PREFIX}{label} {text}\n" for label, text in train_rows),
                              encoding="utf-8")
        started = time.perf_counter()
        model = fasttext_new.train_supervised(
            input=str(train_file), epoch=config.epoch, lr=config.lr, dim=config.dim, wordNgrams=config.word_ngrams,
            bucket=config.bucket, minCount=1, loss="softmax", thread=1, seed=config.seed, verbose=0)
        train_seconds = time.perf_counter() - started
    with atomic_path(out) as written:
        model.save_model(str(written))
    classifier = QualityClassifier(out)  # read back as ingest will: through fasttext-predict
    right = sum((classifier.score(text, POSITIVE_LABEL) >= 0.5) == (label == POSITIVE_LABEL)
                for label, text in held_out)
    accuracy = right / len(held_out) if held_out else None
    return ClassifierTrainingSummary(out, len(examples[POSITIVE_LABEL]), len(examples[NEGATIVE_LABEL]),
                                     len(held_out), accuracy, train_seconds)


def _split_examples(examples: dict[str, list[str]], config: ClassifierTrainingConfig
                    ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(training rows, held-out rows)``, each ``(label, text)``; held out by content hash, so adding
    examples never moves one between the two; training rows shuffled with the seed (fastText reads in order)."""
    train_rows, held_out = [], []
    for label, texts in examples.items():
        for text in texts:
            bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
            (held_out if bucket < config.held_out_fraction else train_rows).append((label, text))
    random.Random(config.seed).shuffle(train_rows)
    return train_rows, held_out


class QualityClassifier:
    """A fastText classifier loaded with fasttext-predict; call :func:`check_model_file` on the file first."""

    def __init__(self, path: Path) -> None:
        import fasttext  # fasttext-predict: loaded only when a manifest names a classifier

        self._model: Any = fasttext.load_model(str(path))

    def score(self, text: str, label: str) -> float:
        """Probability (0..1) of ``label`` (with or without ``__label__``) for ``text`` (:func:`classifier_text`)."""
        sample = classifier_text(text)
        if not sample:
            return 0.0
        labels, scores = self._model.predict(sample, k=-1, threshold=0.0)
        wanted = LABEL_PREFIX + label.removeprefix(LABEL_PREFIX)
        return next((min(float(score), 1.0) for name, score in zip(labels, scores, strict=True) if name == wanted), 0.0)


@functools.cache
def loaded_classifier(path: Path, sha256: str) -> QualityClassifier:
    """The process's classifier for the file at ``path`` with that content: loaded once per worker.

    Raises :class:`ConfigError` when the file no longer has the ``sha256`` the manifest was checked with.
    """
    if sha256_file(path) != sha256:
        raise ConfigError(f"{path}: the classifier model changed while the run was reading it; run again")
    return QualityClassifier(path)


@functools.lru_cache(maxsize=16)
def check_model_file(path: Path, size: int, mtime_ns: int, inode: int) -> tuple[tuple[str, ...], str]:
    """``(labels, sha256)`` of the fastText classifier at ``path`` (cached by size, mtime and inode: a manifest is
    loaded by every ingest part, the file is walked and hashed once per process while it stays the same).

    Raises ValueError with what is wrong (not a fastText model, cut short, word vectors rather than a
    classifier); the caller names the file and key.
    """
    try:
        info = read_model_info(path)
    except NotAFastTextModel as err:
        raise ValueError(f"is not a fastText model ({err})") from None
    if not info.is_classifier or not info.labels:
        raise ValueError("is a fastText model of word vectors, not a classifier")
    return info.labels, sha256_file(path)


def label_names(labels: tuple[str, ...]) -> str:
    """Labels as a message shows them: sorted, without ``__label__``."""
    return ", ".join(sorted(re.sub(f"^{LABEL_PREFIX}", "", label) for label in labels))
