"""Preference run dirs for the trainer's DPO tests: the standard-library corpus cut into pairs, packed into preference
shards (:func:`tokenization.preference.pack.pack_pairs` + ``write_chat_shard(records="preference")``) and indexed as
the preference data stage lays them out, with a tiny Hugging Face model as the base (reference) model.

Each pair is a run of a real document's tokens: a prompt, then as the chosen answer the tokens that follow it, and as
the rejected answer the tokens after those (another continuation of the same text): the trainer sees what the
preference data stage writes without a template or the stage itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from core.files.atomic import sha256_file
from core.layout import pack_unit
from core.rundir import RunPaths
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.store import ShardRows, shard_relpath, write_shard_index
from core.stage import run_stage
from tests.trainer.conftest import SEQ_LEN, TEST_TRAIN, VOCAB_SIZE, Corpus
from tests.trainer.test_hf_models import save_tiny_model, use_hf_model
from tokenization.chat.masks import MaskedConversation
from tokenization.preference.masks import MaskedPair
from tokenization.preference.pack import pack_pairs
from trainer.loader.batches import PAD_ID
from trainer.preference.reference_stage import ReferenceStage
from trainer.run_config import read_trainer_config

PAIRS_PER_SOURCE = {"train": 48, "val": 12}
"""Pairs per (split, source): a few dozen packed rows, enough for the few steps a test trains."""


def cut_pairs(docs: list[np.ndarray], first_id: int, seed: int, count: int) -> list[tuple[int, MaskedPair]]:
    """Documents cut into pairs: a 4-10 token prompt, a 3-12 token chosen and a 3-12 token rejected continuation."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, MaskedPair]] = []
    for doc in docs:
        start = 0
        while start + 40 <= len(doc) and len(out) < count:
            prompt_len, chosen_len, rejected_len = (int(n) for n in (rng.integers(4, 11), *rng.integers(3, 13, 2)))
            prompt = doc[start:start + prompt_len].tolist()
            chosen = doc[start + prompt_len:start + prompt_len + chosen_len].tolist()
            rejected = doc[start + prompt_len + chosen_len:start + prompt_len + chosen_len + rejected_len].tolist()
            out.append((first_id + len(out), MaskedPair(_side(prompt, chosen), _side(prompt, rejected), len(prompt))))
            start += prompt_len + chosen_len + rejected_len
    return out


def _side(prompt: list[int], completion: list[int]) -> MaskedConversation:
    return MaskedConversation(prompt + completion, [0] * len(prompt) + [1] * len(completion), "prefix_diff")


def write_preference_shards(run_dir: Path, corpus: Corpus, seq_len: int = SEQ_LEN) -> None:
    """The tokenizer, preference shards of every (split, source) (two per train source) and the shard index."""
    tokenizer_path = run_dir / "tokenizer" / "tokenizer.json"
    tokenizer_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_path.write_text(corpus.tokenizer_json, encoding="utf-8")
    tokenizer_sha = sha256_file(tokenizer_path)
    infos = []
    for number, ((split, source), docs) in enumerate(sorted(corpus.docs.items())):
        pairs = cut_pairs(docs, number * 10_000, number, PAIRS_PER_SOURCE[split])
        chat = pack_pairs(pairs, seq_len, PAD_ID, np.dtype(np.uint16))
        rows_per_shard = len(chat) if split == "val" else -(-len(chat) // 2)
        for part, lo in enumerate(range(0, len(chat), rows_per_shard)):
            cut = slice(lo, lo + rows_per_shard)
            rows = chat.rows
            part_rows = ShardRows(rows.input_ids[cut], rows.doc_ids[cut], rows.doc_starts[cut],
                                  rows.first_doc_offset[cut], rows.num_tokens[cut])
            infos.append(write_chat_shard(run_dir, shard_relpath(split, source, part),
                                          ChatRows(part_rows, chat.loss_mask[cut]), split=split, source=source,
                                          tokenizer_sha256=tokenizer_sha, vocab_size=VOCAB_SIZE,
                                          records="preference"))
    write_shard_index(run_dir, infos)


def make_preference_run_dir(root: Path, corpus: Corpus, name: str = "dpo", model_type: str | None = "llama",
                            dpo: dict[str, Any] | None = None, references: bool = True, **train: Any) -> Path:
    """A ready dpo run dir under ``root``: preference shards, run.yaml with ``train.mode: dpo`` (+ ``dpo`` and
    ``train``), ``model.from_pretrained`` a tiny ``model_type`` (None: the built-in model), and with ``references``
    the reference stage's files computed (when the recipe reads stored ones)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    write_preference_shards(run_dir, corpus)
    settings = {**TEST_TRAIN, "mode": "dpo", "lr": 1e-2, **({"dpo": dpo} if dpo is not None else {}), **train}
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
    if references and read_trainer_config(run_dir).train.dpo.stored_reference:
        compute_references(run_dir)
    return run_dir


def reference_stage(run_dir: Path) -> ReferenceStage:
    """The reference stage of ``run_dir`` as the flow builds it from the recipe."""
    config = read_trainer_config(run_dir)
    return ReferenceStage(RunPaths(run_dir), config.model, config.train.precision)


def compute_references(run_dir: Path) -> list[str]:
    """Run every unit of the reference stage; its units."""
    stage = reference_stage(run_dir)
    for unit in stage.units():
        run_stage(stage, unit)
    return stage.units()


def unit_of(split: str, source: str) -> str:
    return pack_unit(split, source)
