"""Hugging Face model folders in the three tokenizer styles pack meets, built locally (no downloads).

GPT-2: ``<|endoftext|>`` is EOS (and nominal BOS, never added), no pad. Llama: ``<s>`` added by a
TemplateProcessing post-processor, ``</s>`` EOS, no pad. Qwen2: ``<|endoftext|>`` EOS and pad, no BOS.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 400


def stdlib_sample(num_files: int = 4) -> list[str]:
    """A few top-level standard-library sources (a stable, local training text)."""
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:num_files]
    return [path.read_text(encoding="utf-8") for path in paths]


def byte_level_bpe(special_tokens: list[str], bos: str | None = None) -> Tokenizer:
    """A byte-level BPE whose specials get ids 0.. in order; ``bos``: a post-processor that starts texts with it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(stdlib_sample(), trainer=trainer)
    if bos is not None:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def write_model_folder(folder: Path, tokenizer: Tokenizer, tokenizer_config: dict[str, Any] | None,
                       config: dict[str, Any]) -> Path:
    """``folder`` with tokenizer.json, tokenizer_config.json (unless None) and config.json, as save_pretrained does."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def gpt2_folder(folder: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    tokenizer = byte_level_bpe(["<|endoftext|>"])
    eos = tokenizer.token_to_id("<|endoftext|>")
    return write_model_folder(
        folder, tokenizer,
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_prefix_space": False,
         "tokenizer_class": "GPT2Tokenizer"},
        {"model_type": "gpt2", "vocab_size": vocab_size, "bos_token_id": eos, "eos_token_id": eos})


def llama_folder(folder: Path, add_bos_token: bool | None = True) -> Path:
    tokenizer = byte_level_bpe(["<unk>", "<s>", "</s>"], bos="<s>")
    tokenizer_config: dict[str, Any] = {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False},
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False},
        "pad_token": None, "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}
    if add_bos_token is not None:
        tokenizer_config["add_bos_token"] = add_bos_token
    return write_model_folder(folder, tokenizer, tokenizer_config,
                              {"model_type": "llama", "vocab_size": VOCAB_SIZE, "bos_token_id": 1,
                               "eos_token_id": 2})


def qwen2_folder(folder: Path, tokenizer_config: bool = True) -> Path:
    tokenizer = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return write_model_folder(
        folder, tokenizer,
        {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"} if tokenizer_config else None,
        {"model_type": "qwen2", "vocab_size": VOCAB_SIZE + 16, "bos_token_id": 0, "eos_token_id": [0, 2]})
