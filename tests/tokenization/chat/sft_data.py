"""Shared by the packing and SFT-loss tests: chat records of different lengths, their masks, and tiny Llamas.

Two models with random weights (nothing trains): a ``transformers`` Llama built from ``AutoConfig.for_model``
(as ``model.hf_config`` builds one) and tokenmill's own Llama; both are what the trainer calls with
``position_ids`` under ``train.document_masking``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import AutoConfig

from tokenization.chat.masks import MaskedConversation, mask_conversation
from tokenization.chat.records import Conversation, parse_record
from tokenization.chat.template import ChatTemplate
from trainer.config import ModelDims
from trainer.model.hf_model import build_hf_model
from trainer.model.llama import ModelShape, build_model


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


RECORDS: list[dict[str, Any]] = [
    {"messages": [user("What is a tuple in Python?"), assistant("An immutable sequence: (1, 2) can't change.")]},
    {"messages": [user("Name a mutable one."), assistant("A list, e.g. [1, 2, 3]."), user("And a set?"),
                  assistant("Unordered, unique items: {1, 2}.")]},
    {"messages": [user("len?"), assistant("Counts items.")]},
    {"messages": [user("How do I open a file for reading and iterate over its lines in order?"),
                  assistant("Use `with open(path) as f:` then `for line in f:`; the file closes itself after.")]},
    {"messages": [user("Define a dict."), assistant("A mapping of keys to values.")]},
    {"messages": [user("What does str.split do without arguments?"),
                  assistant("It splits on runs of whitespace and drops empty strings."), user("With ','?"),
                  assistant("It splits on every comma, keeping empty fields.")]},
]
"""Alternating user/assistant turns (every family renders them), 9 to ~60 tokens each."""


def masked_records(template: ChatTemplate, records: list[dict[str, Any]] = RECORDS,
                   **settings: Any) -> list[MaskedConversation]:
    out = []
    for record in records:
        conversation = parse_record(record)
        assert isinstance(conversation, Conversation), conversation
        result = mask_conversation(template, conversation, **settings)
        assert isinstance(result, MaskedConversation), result
        out.append(result)
    return out


INIT_STD = 0.3
"""Far from the usual 0.02: logits that differ from token to token, so a conversation seeing another changes its loss
by far more than the tolerance (with near-uniform logits the loss barely moves)."""


def tiny_hf_llama(vocab_size: int, seq_len: int, seed: int = 0) -> nn.Module:
    config = AutoConfig.for_model("llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=seq_len, initializer_range=INIT_STD)
    return build_hf_model(config, seed).eval()


def tiny_tokenmill_llama(vocab_size: int, seq_len: int, seed: int = 0) -> nn.Module:
    dims = ModelDims(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return build_model(ModelShape(dims, vocab_size, seq_len), seed).eval()
