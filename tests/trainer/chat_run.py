"""Chat run dirs for the trainer's SFT tests: the standard-library corpus cut into conversations, packed into chat
shards (:func:`core.shards.chat.write_chat_shard`) and indexed as the chat data stage lays them out.

Each conversation is a run of a real document's tokens whose first ~40% plays the prompt and the rest the assistant's
answer (the loss mask): the trainer sees what the chat data stage writes without a template or the stage itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.files.atomic import sha256_file
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.store import ShardRows, shard_relpath, write_shard_index
from tests.trainer.conftest import ROWS_PER_SHARD, SEQ_LEN, TEST_TRAIN, VOCAB_SIZE, Corpus
from tests.trainer.test_hf_models import save_tiny_model, use_hf_model
from tokenization.chat.masks import MaskedConversation
from tokenization.chat.pack import pack_conversations
from trainer.loader.batches import PAD_ID

CONVERSATIONS_PER_SOURCE = 120
"""Conversations per (split, source): a few dozen packed rows, enough for the few steps a test trains."""
PROMPT_FRACTION = 0.4


def cut_conversations(docs: list[np.ndarray], first_id: int, seed: int) -> list[tuple[int, MaskedConversation]]:
    """Documents cut into conversations of 10 to 40 tokens, each masked on its answer part."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, MaskedConversation]] = []
    for doc in docs:
        start = 0
        while start + 10 <= len(doc) and len(out) < CONVERSATIONS_PER_SOURCE:
            length = int(rng.integers(10, 41))
            ids = doc[start:start + length].tolist()
            prompt = max(1, int(len(ids) * PROMPT_FRACTION))
            out.append((first_id + len(out), MaskedConversation(ids, [0] * prompt + [1] * (len(ids) - prompt),
                                                                "all_tokens")))
            start += length
    return out


def write_chat_shards(run_dir: Path, corpus: Corpus, seq_len: int = SEQ_LEN) -> dict[tuple[str, str], ChatRows]:
    """The tokenizer, chat shards of every (split, source) (several per train source) and the shard index."""
    tokenizer_path = run_dir / "tokenizer" / "tokenizer.json"
    tokenizer_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_path.write_text(corpus.tokenizer_json, encoding="utf-8")
    tokenizer_sha = sha256_file(tokenizer_path)
    infos, written = [], {}
    for number, ((split, source), docs) in enumerate(sorted(corpus.docs.items())):
        chat = pack_conversations(cut_conversations(docs, number * 10_000, number), seq_len, PAD_ID, np.uint16)
        written[(split, source)] = chat
        rows_per_shard = ROWS_PER_SHARD if split == "val" else max(1, len(chat) // 2)  # several train shards
        for part, lo in enumerate(range(0, len(chat), rows_per_shard)):
            cut = slice(lo, lo + rows_per_shard)
            rows = chat.rows
            part_rows = ShardRows(rows.input_ids[cut], rows.doc_ids[cut], rows.doc_starts[cut],
                                  rows.first_doc_offset[cut], rows.num_tokens[cut])
            infos.append(write_chat_shard(run_dir, shard_relpath(split, source, part),
                                          ChatRows(part_rows, chat.loss_mask[cut]), split=split, source=source,
                                          tokenizer_sha256=tokenizer_sha, vocab_size=VOCAB_SIZE))
    write_shard_index(run_dir, infos)
    return written


def make_chat_run_dir(root: Path, corpus: Corpus, name: str = "chat", model_type: str | None = "llama",
                      **train: Any) -> Path:
    """A ready SFT run dir under ``root``: chat shards, run.yaml with ``train.mode: sft`` (+ ``train``), and
    ``model.from_pretrained`` a tiny ``model_type`` (None: tokenmill's built-in model)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    write_chat_shards(run_dir, corpus)
    settings = {**TEST_TRAIN, "mode": "sft", **train}
    recipe = {"name": name, "data": {"manifests": ["unused.yaml"]}, "pack": {"seq_len": SEQ_LEN},
              "model": {"dims": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                                 "intermediate_size": 64}},
              "train": settings, "code_version": "test"}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    if model_type is not None:
        source = root / f"{name}-source"
        if not source.exists():
            save_tiny_model(source, model_type)
        use_hf_model(run_dir, source, key="from_pretrained")
    return run_dir
