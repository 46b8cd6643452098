"""Tokenizer step of the data path: train-split documents -> ``tokenizer/tokenizer.json`` (byte-level BPE).

Either trains a byte-level BPE on the first ``sample_bytes`` of train-split text (documents order) or
copies a given ``tokenizer.json``. Either way the file is written atomically and the stage marker
``stages/tokenizer.json`` records the settings fingerprint, so a re-run with the same settings is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from core.atomic import sha256_file
from core.documents import iter_documents
from core.errors import ConfigError
from core.rundir import RunPaths, fingerprint
from tokenization.config import SPECIAL_TOKENS, TokenizerConfig
from tokenization.encode import PIECE_CHARS, split_text

EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS


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


def load_tokenizer(path: Path) -> Tokenizer:
    """Load a ``tokenizer.json``; raises ConfigError naming the file when it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: tokenizer file not found; run the tokenizer stage first or fix tokenizer.path.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for every parse error
        raise ConfigError(
            f"{path}: not a valid tokenizer.json ({err}); point tokenizer.path at a file saved by "
            "`tokenizers` (Tokenizer.save) or delete it so the stage trains a new one."
        ) from None


def special_token_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos_id, pad_id): the ids of ``<|endoftext|>`` and ``<|pad|>``; ConfigError when either is absent."""
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    if eos_id is None or pad_id is None:
        missing = [name for name, token_id in ((EOS_TOKEN, eos_id), (PAD_TOKEN, pad_id)) if token_id is None]
        raise ConfigError(
            f"tokenizer lacks the special tokens {missing}; add them (tokenizer.add_special_tokens"
            f"({SPECIAL_TOKENS})) and save it again, or train one with tokenizer.vocab_size."
        )
    return eos_id, pad_id


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int:
    """Number of ids the tokenizer can emit (largest id + 1, added tokens included)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def prepare_tokenizer(paths: RunPaths, config: TokenizerConfig, given_path: Path | None,
                      on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write ``paths.tokenizer`` (copied from ``given_path``, or trained) and return its summary.

    Returns ``{"tokenizer_sha256", "vocab_size", "trained", "sample_bytes"}``. Skipped when ``stages/tokenizer.json``
    records the same settings fingerprint and the file is unchanged. The documents are deliberately not
    part of the fingerprint: an incremental run with new documents keeps the tokenizer its shards were
    written with (delete ``tokenizer/`` and ``shards/`` to retrain). Raises ConfigError for an invalid
    given file or when there is no train-split text to train on. When it trains, ``on_progress(num_bytes_fed,
    num_bytes_total)`` follows the trainer through the sample.
    """
    given = Path(given_path) if given_path is not None else None
    if given is not None and not given.is_file():
        raise ConfigError(f"{given}: tokenizer.path does not exist; fix the path in the recipe.")
    settings = {"given_sha256": sha256_file(given)} if given is not None else _training_settings(config)
    stage_fingerprint = fingerprint("tokenizer", settings)
    done = _recorded_summary(paths, stage_fingerprint)
    if done is not None:
        return done
    summary = _copy_given(paths, given) if given is not None else _train_from_documents(paths, config, on_progress)
    paths.mark_done("tokenizer", stage_fingerprint, summary)
    return summary


def _training_settings(config: TokenizerConfig) -> dict[str, Any]:
    if config.vocab_size is None:
        raise ConfigError("tokenizer: set tokenizer.vocab_size (train) or tokenizer.path (load) in the recipe.")
    return {"vocab_size": config.vocab_size, "sample_bytes": config.sample_bytes,
            "min_frequency": config.min_frequency}


def _recorded_summary(paths: RunPaths, stage_fingerprint: str) -> dict[str, Any] | None:
    """The recorded summary when the tokenizer on disk was made with this fingerprint and is intact."""
    if not paths.tokenizer.is_file():
        return None
    summary = paths.done_summary("tokenizer", stage_fingerprint)
    if summary is None or summary.get("tokenizer_sha256") != sha256_file(paths.tokenizer):
        return None
    return summary


def _copy_given(paths: RunPaths, given_path: Path) -> dict[str, Any]:
    tokenizer = load_tokenizer(given_path)
    try:
        special_token_ids(tokenizer)
    except ConfigError as err:
        raise ConfigError(f"{given_path}: {err}") from None
    paths.write_bytes(paths.tokenizer, given_path.read_bytes())  # byte copy: same sha256 as the user's file
    return {"tokenizer_sha256": sha256_file(paths.tokenizer), "vocab_size": tokenizer_vocab_size(tokenizer),
            "trained": False, "sample_bytes": 0}


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
