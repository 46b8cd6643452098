"""Tokenizer step of the data path: train-split documents -> ``tokenizer/tokenizer.json`` (byte-level BPE).

Either trains a byte-level BPE on the first ``sample_bytes`` of train-split text (documents order), copies a
given ``tokenizer.json``, or copies a Hugging Face model folder's own (with its special ids in
``tokenizer/special_tokens.json``), so shards are in the model's ids. Either way the file is written
atomically and the stage marker ``stages/tokenizer.json`` records the settings fingerprint, so a re-run with
the same settings is skipped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from core.documents import iter_documents
from core.errors import ConfigError
from core.files.atomic import read_json, sha256_file
from core.layout import HF_CONFIG_FILE, TOKENIZER_FILE
from core.rundir import RunPaths
from core.stage import Inputs, Progress, Stage, read_marker, run_stage
from tokenization.config import SPECIAL_TOKENS, TokenizerConfig
from tokenization.encode import PIECE_CHARS, split_text
from tokenization.special_tokens import (
    load_tokenizer,
    model_special_tokens,
    special_token_ids,
    write_special_tokens,
)

EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS

MODEL_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", HF_CONFIG_FILE)
"""The files of a Hugging Face model folder its tokenizer and special ids are read from (the stage's fingerprint)."""


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    on_progress: Callable[[int], None] | None = None) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (specials get ids 0, 1); deterministic for the same texts.

    Every byte has a token (initial alphabet = the 256 byte symbols), so any text encodes without unknowns.
    ``on_progress(num_bytes)`` hears of each text's UTF-8 bytes once the trainer has taken it; the merges
    that follow the last text report nothing.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Long texts are cut where the pre-tokenizer splits anyway: same word counts, bounded memory.
    tokenizer.train_from_iterator(_pieces(texts, on_progress), trainer=trainer)
    return tokenizer


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (largest id + 1, added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def prepare_tokenizer(paths: RunPaths, config: TokenizerConfig | None, given_path: Path | None,
                      on_progress: Callable[[int, int], None] | None = None,
                      model_folder: Path | None = None) -> dict[str, Any]:
    """Write ``paths.tokenizer`` (copied from ``given_path`` or the model folder, or trained) and return its summary.

    ``config`` None: the Hugging Face model folder ``model_folder`` (``RUN/base_model``) brings the tokenizer; its
    ``tokenizer.json`` is copied byte for byte and its special ids go to ``tokenizer/special_tokens.json``.
    ``model_folder`` given: a tokenizer with more ids than its ``config.json`` ``vocab_size`` is refused.

    Returns ``{"tokenizer_sha256", "vocab_size", "trained", "sample_bytes"}``. Skipped when ``stages/tokenizer.json``
    records the same settings fingerprint and the file is unchanged. The documents are deliberately not
    part of the fingerprint: an incremental run with new documents keeps the tokenizer its shards were
    written with (delete ``tokenizer/`` and ``shards/`` to retrain). Raises ConfigError for an invalid
    given file or model folder, a tokenizer that does not fit the model, or when there is no train-split text
    to train on. When it trains, ``on_progress(num_bytes_fed, num_bytes_total)`` follows the trainer through
    the sample.
    """
    stage = TokenizerStage(paths, config, Path(given_path) if given_path is not None else None, model_folder)
    return run_stage(stage, on_progress=on_progress).as_summary()


class TokenizerStage(Stage):
    """Documents (train split), a given file or the model folder -> ``tokenizer/tokenizer.json``."""

    name = "tokenizer"
    reads = ("ingest", "dedupe", "decontaminate", "base-model")
    progress_unit = "bytes"

    def __init__(self, paths: RunPaths, config: TokenizerConfig | None, given: Path | None,
                 model_folder: Path | None = None) -> None:
        super().__init__(paths)
        self.config, self.given, self.model_folder = config, given, model_folder

    @classmethod
    def build(cls, run: Any) -> TokenizerStage:
        config, given = run.recipe.tokenizer, None
        if config is not None and config.path is not None:
            given = (run.base / config.path).resolve()
        return cls(run.paths, config, given, run.paths.base_model if run.recipe.model.is_hugging_face else None)

    @property
    def from_model(self) -> bool:
        return self.config is None and self.given is None

    def inputs(self, unit: str | None) -> Inputs:
        """The settings only: the documents are deliberately not an input (see :func:`prepare_tokenizer`)."""
        if self.given is not None and not self.given.is_file():
            raise ConfigError(f"{self.given}: tokenizer.path does not exist; fix the path in the recipe.")
        settings = _settings(self.config, self.given, self.model_folder if self.from_model else None)
        recorded = read_marker(self.paths, self.name)
        if self.model_folder is not None and recorded is not None:  # a skipped stage still refuses a model too small
            _check_fits_model(recorded["summary"]["vocab_size"], Path(self.model_folder))
        return Inputs(settings=settings)

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.tokenizer, *([self.paths.special_tokens] if self.from_model else [])]

    def changed_since(self, unit: str | None, recorded: dict[str, Any]) -> list[Path]:
        """The tokenizer, when its bytes are not the ones recorded (edited or replaced since)."""
        intact = recorded["summary"].get("tokenizer_sha256") == sha256_file(self.paths.tokenizer)
        return [] if intact else [self.paths.tokenizer]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        paths = self.paths
        if self.from_model:
            assert self.model_folder is not None  # checked by _settings
            summary = _copy_model_tokenizer(paths, Path(self.model_folder))
        else:
            paths.special_tokens.unlink(missing_ok=True)  # the named tokens of this tokenizer are the special ids
            summary = (_copy_given(paths, self.given) if self.given is not None
                       else _train_from_documents(paths, self.config, on_progress))
        if self.model_folder is not None:
            _check_fits_model(summary["vocab_size"], Path(self.model_folder))
        return summary


def check_tokenizer_fits(tokenizer_vocab_size: int, embedding_rows: int, where: str) -> None:
    """ConfigError naming both numbers when the tokenizer emits ids the model's embedding has no row for.

    ``where``: what the numbers were read from (a file, a run dir), put first in the message.
    """
    if tokenizer_vocab_size > embedding_rows:
        raise ConfigError(
            f"{where}: the tokenizer has {tokenizer_vocab_size} ids but the model's embedding has only "
            f"{embedding_rows} rows; ids from {embedding_rows} on could not be embedded. Use the model's own "
            "tokenizer (remove the recipe's tokenizer section), a tokenizer.path or tokenizer.vocab_size of at most "
            f"{embedding_rows} ids, or a model (model.hf_config) whose vocab_size is at least {tokenizer_vocab_size}."
        )


def _settings(config: TokenizerConfig | None, given: Path | None, model_folder: Path | None) -> dict[str, Any]:
    """What the tokenizer is made from (the stage fingerprint's settings); unchanged for a given or trained one."""
    if given is not None:
        return {"given_sha256": sha256_file(given)}
    if config is not None:
        return _training_settings(config)
    if model_folder is None:
        raise ConfigError("tokenizer: the recipe has no tokenizer section and no Hugging Face model to take one "
                          "from; set tokenizer.vocab_size or tokenizer.path, or model.from_pretrained.")
    files = [Path(model_folder) / name for name in MODEL_TOKENIZER_FILES]
    return {"model_files_sha256": {path.name: sha256_file(path) for path in files if path.is_file()}}


def _training_settings(config: TokenizerConfig) -> dict[str, Any]:
    if config.vocab_size is None:
        raise ConfigError("tokenizer: set tokenizer.vocab_size (train) or tokenizer.path (load) in the recipe.")
    return {"vocab_size": config.vocab_size, "sample_bytes": config.sample_bytes,
            "min_frequency": config.min_frequency}


def _copy_given(paths: RunPaths, given_path: Path) -> dict[str, Any]:
    tokenizer = load_tokenizer(given_path)
    try:
        special_token_ids(tokenizer)
    except ConfigError as err:
        raise ConfigError(f"{given_path}: {err}") from None
    paths.write_bytes(paths.tokenizer, given_path.read_bytes())  # byte copy: same sha256 as the user's file
    return {"tokenizer_sha256": sha256_file(paths.tokenizer), "vocab_size": tokenizer_vocab_size(tokenizer),
            "trained": False, "sample_bytes": 0}


def _copy_model_tokenizer(paths: RunPaths, folder: Path) -> dict[str, Any]:
    """Copy the model folder's tokenizer.json byte for byte and record its special ids (special_tokens.json first)."""
    source = folder / TOKENIZER_FILE
    if not source.is_file():
        raise ConfigError(
            f"{folder}: the model folder has no tokenizer.json, and the recipe has no tokenizer section; add a "
            "tokenizer section (tokenizer.path to the model's tokenizer.json, or tokenizer.vocab_size to train one "
            "with model.hf_config), or put the model's tokenizer.json in its folder."
        )
    tokenizer = load_tokenizer(source)
    special = model_special_tokens(folder, tokenizer)
    if special.pad_is_eos:
        warnings.warn(f"{folder}: the model's tokenizer has no pad token; padding uses its EOS id {special.eos_id} "
                      "and those padding labels are masked (each document's own EOS is still learned).", stacklevel=3)
    write_special_tokens(paths, special)
    paths.write_bytes(paths.tokenizer, source.read_bytes())  # byte copy: same sha256 as the model's file
    return {"tokenizer_sha256": sha256_file(paths.tokenizer), "vocab_size": tokenizer_vocab_size(tokenizer),
            "trained": False, "sample_bytes": 0}


def _check_fits_model(vocab_size: int, model_folder: Path) -> None:
    """check_tokenizer_fits against the model folder's ``config.json`` ``vocab_size`` (no check without one)."""
    config_path = model_folder / HF_CONFIG_FILE
    if not config_path.is_file():
        return
    embedding_rows = read_json(config_path).get("vocab_size")
    if isinstance(embedding_rows, int):
        check_tokenizer_fits(vocab_size, embedding_rows, f"{config_path} vocab_size")


def _train_from_documents(paths: RunPaths, config: TokenizerConfig,
                          on_progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    assert config.vocab_size is not None  # checked by _training_settings
    sample = list(sample_texts(paths, config.sample_bytes))
    sample_bytes = sum(len(text.encode("utf-8")) for text in sample)
    if not sample_bytes:
        raise ConfigError(
            f"{paths.docs}: no train-split text to train a tokenizer on; run ingest first, or set "
            "tokenizer.path to an existing tokenizer.json."
        )
    tokenizer = train_tokenizer(sample, config.vocab_size, config.min_frequency,
                                _fed_of(sample_bytes, on_progress) if on_progress else None)
    paths.write_text(paths.tokenizer, tokenizer.to_str(pretty=True))
    return {"tokenizer_sha256": sha256_file(paths.tokenizer), "vocab_size": tokenizer_vocab_size(tokenizer),
            "trained": True, "sample_bytes": sample_bytes}


def sample_texts(paths: RunPaths, sample_bytes: int) -> Iterator[str]:
    """Train-split texts in documents order until ``sample_bytes`` UTF-8 bytes; the last one is cut to fit."""
    remaining = sample_bytes
    for batch in iter_documents(paths, split="train", columns=["text"]):
        for text in batch.column("text").to_pylist():
            data = text.encode("utf-8")
            if len(data) >= remaining:
                yield data[:remaining].decode("utf-8", errors="ignore")
                return
            remaining -= len(data)
            yield text


def _fed_of(num_bytes_total: int, on_progress: Callable[[int, int], None]) -> Callable[[int], None]:
    """Turn per-text byte counts into ``on_progress(num_bytes_fed, num_bytes_total)``."""
    num_bytes_fed = 0

    def report(num_bytes: int) -> None:
        nonlocal num_bytes_fed
        num_bytes_fed += num_bytes
        on_progress(num_bytes_fed, num_bytes_total)

    return report


def _pieces(texts: Iterable[str], on_progress: Callable[[int], None] | None) -> Iterator[str]:
    for text in texts:
        yield from split_text(text, PIECE_CHARS) if len(text) > PIECE_CHARS else (text,)
        if on_progress is not None:
            on_progress(len(text.encode("utf-8")))
