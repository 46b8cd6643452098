"""Settings of the tokenizer and packing stages (the ``tokenizer`` and ``pack`` sections of a recipe)."""

from __future__ import annotations

from pydantic import Field, model_validator

from core.config import FrozenConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
"""Special tokens of a trained tokenizer, with ids 0 and 1: end-of-document (EOS) and padding."""


class TokenizerConfig(FrozenConfig):
    vocab_size: int | None = Field(default=None, ge=258, le=1 << 20)
    """Train a byte-level BPE with this many tokens (specials + 256 bytes + merges)."""
    path: str | None = None
    """Or load this ``tokenizer.json`` (relative to the recipe's folder) instead of training."""
    sample_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Train on (about) this many bytes of train-split text, taken in doc_id order (deterministic)."""
    min_frequency: int = Field(default=2, ge=1)
    """A merge must occur at least this often in the sample."""

    @model_validator(mode="after")
    def _exactly_one_of_vocab_size_or_path(self) -> TokenizerConfig:
        if (self.vocab_size is None) == (self.path is None):
            raise ValueError("set exactly one of tokenizer.vocab_size (train) or tokenizer.path (load)")
        return self


class PackConfig(FrozenConfig):
    seq_len: int = Field(default=256, ge=8, le=1 << 20)
    """Tokens per packed row (the model's context length)."""
    rows_per_shard: int = Field(default=4096, ge=1)
    """Rows per Arrow shard file."""
    encode_batch_docs: int = Field(default=256, ge=1)
    """Documents per ``encode_batch`` call."""
