"""A tiny DPO run dir built from the shared contract, and scored: preference shards (pairs packed by
:func:`tokenization.preference.pack.pack_pairs`, written by :func:`core.shards.chat.write_chat_shard` with
``records="preference"``) and their index, the pairs as documents (``record``: the pair as JSON), a reference
model's log-probs in ``reference/`` (written by the reference store) and two checkpoints' scores
(:func:`trainer.eval.preference.score_preference_pairs` with two tiny models of tokenmill's own Llama).

The expectations come from another path: each pair's log-probs under each model with one padded row per side
(:func:`trainer.preference.pair_batch.pad_pairs`), not the packed shard rows the code under test reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from accelerate.state import AcceleratorState, GradientState
from tokenizers import Tokenizer, models

from core.rundir import RunPaths
from core.schemas import CHAT_DOCUMENTS_SCHEMA
from core.shards.chat import write_chat_shard
from core.shards.store import ShardRows, shard_relpath, write_shard_index
from tokenization.chat.masks import MaskedConversation
from tokenization.preference.masks import MaskedPair
from tokenization.preference.pack import pack_pairs
from trainer.config import ModelDims, TrainConfig
from trainer.eval.preference import score_preference_pairs
from trainer.model.llama import ModelShape, build_model
from trainer.parallel.accelerator import build_accelerator
from trainer.preference.pair_batch import pad_pairs, pair_logps
from trainer.preference.reference_store import PairKey, reference_table, write_reference_logps

VOCAB_SIZE = 64
SEQ_LEN = 40
BETA = 0.25
DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
SPLITS = {("train", "qa"): 6, ("val", "code"): 4, ("val", "qa"): 5}
"""Pairs per (split, source)."""
STEPS = {2: 1, 4: 2}
"""Checkpoint step -> the seed of its model; the reference model has seed 0."""
SETTINGS = {"beta": BETA, "label_smoothing": 0.0, "loss": "sigmoid", "simpo_gamma": 0.5}


@dataclass(frozen=True)
class ScoredRun:
    run_dir: Path
    pairs: dict[int, tuple[str, str, MaskedPair]]
    """doc id -> (split, source, pair)."""
    expected: dict[int, dict[int, tuple[float, float]]]
    """model (0: reference, else a checkpoint step) -> doc id -> (chosen, rejected) log-probs, each pair alone."""


def model_of(seed: int) -> torch.nn.Module:
    return build_model(ModelShape(DIMS, VOCAB_SIZE, SEQ_LEN), seed=seed).eval()


def make_pairs(rng: np.random.Generator, first_id: int, count: int) -> list[tuple[int, MaskedPair]]:
    def side(prompt: list[int], completion: list[int]) -> MaskedConversation:
        return MaskedConversation(prompt + completion, [0] * len(prompt) + [1] * len(completion), "prefix_diff")

    pairs = []
    for number in range(count):
        prompt = rng.integers(2, VOCAB_SIZE, int(rng.integers(3, 7))).tolist()
        chosen, rejected = (rng.integers(2, VOCAB_SIZE, int(rng.integers(2, 6))).tolist() for _ in range(2))
        pairs.append((first_id + number, MaskedPair(side(prompt, chosen), side(prompt, rejected), len(prompt))))
    return pairs


def alone(model: torch.nn.Module, pairs: list[tuple[int, MaskedPair]]) -> dict[int, tuple[float, float]]:
    with torch.no_grad():
        logps = pair_logps(model, pad_pairs([pair for _, pair in pairs], pad_id=1))
    return {doc_id: (float(c), float(r)) for (doc_id, _), c, r in zip(pairs, logps.chosen, logps.rejected,
                                                                      strict=True)}


def write_shards(run_dir: Path, by_unit: dict[tuple[str, str], list[tuple[int, MaskedPair]]]) -> None:
    """Each (split, source) in two shards (so a batch spans shards), and the index."""
    tokenizer = RunPaths(run_dir).tokenizer
    tokenizer.parent.mkdir(parents=True)
    # a word per id: the scores read token ids only, the report counts the ids its vocabulary holds
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB_SIZE)}, unk_token="w0")).save(str(tokenizer))
    infos = []
    for (split, source), pairs in by_unit.items():
        chat = pack_pairs(pairs, SEQ_LEN, pad_id=1, dtype=np.dtype(np.uint16))
        half = max(1, len(chat) // 2)
        for part, cut in enumerate((slice(0, half), slice(half, len(chat)))):
            rows = chat.rows
            part_rows = ShardRows(rows.input_ids[cut], rows.doc_ids[cut], rows.doc_starts[cut],
                                  rows.first_doc_offset[cut], rows.num_tokens[cut])
            if part_rows.input_ids.shape[0]:
                infos.append(write_chat_shard(run_dir, shard_relpath(split, source, part),
                                              type(chat)(part_rows, chat.loss_mask[cut]), split=split,
                                              source=source, tokenizer_sha256="t", vocab_size=VOCAB_SIZE,
                                              records="preference"))
    write_shard_index(run_dir, infos)


def write_documents(paths: RunPaths, pairs: dict[int, tuple[str, str, MaskedPair]]) -> None:
    """Each pair as the data stage keeps it: ``text`` its prompt, ``record`` the pair as JSON messages."""
    rows = []
    for doc_id, (split, source, _) in sorted(pairs.items()):
        record = {"prompt": [{"role": "user", "content": f"question {doc_id}"}],
                  "chosen": [{"role": "assistant", "content": f"good answer {doc_id}"}],
                  "rejected": [{"role": "assistant", "content": f"bad answer {doc_id}"}]}
        rows.append({"doc_id": doc_id, "source": source, "source_id": None, "uri": f"pairs.jsonl:{doc_id}",
                     "text": f"question {doc_id}", "num_chars": 12, "content_hash": f"h{doc_id}", "split": split,
                     "record": json.dumps(record)})
    paths.docs.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=CHAT_DOCUMENTS_SCHEMA), paths.docs / "part-00000.parquet")
    marker = paths.marker("ingest", "part-00000")
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"format": 2, "fingerprint": "f", "inputs": {}, "summary": {}}))


def write_reference(paths: RunPaths, pairs: dict[int, tuple[str, str, MaskedPair]],
                    values: dict[int, tuple[float, float]]) -> None:
    """``reference/split=S/source=N.parquet`` as the reference stage writes them (its reference_store)."""
    for split, source in SPLITS:
        keys = [PairKey(doc_id, split, source) for doc_id, (in_split, in_source, _) in sorted(pairs.items())
                if (in_split, in_source) == (split, source)]
        chosen, rejected = (np.array([values[key.doc_id][side] for key in keys]) for side in (0, 1))
        write_reference_logps(paths, paths.reference_logps(split, source), reference_table(keys, chosen, rejected, "r"))


@pytest.fixture(scope="session")
def scored_run(tmp_path_factory: pytest.TempPathFactory) -> ScoredRun:
    run_dir = tmp_path_factory.mktemp("dpo-run")
    paths = RunPaths(run_dir)
    rng = np.random.default_rng(7)
    by_unit = {unit: make_pairs(rng, 1000 * (number + 1), count) for number, (unit, count) in enumerate(SPLITS.items())}
    pairs = {doc_id: (split, source, pair) for (split, source), unit in by_unit.items() for doc_id, pair in unit}
    write_shards(run_dir, by_unit)
    write_documents(paths, pairs)
    every = [item for unit in by_unit.values() for item in unit]
    expected = {seed_step: alone(model_of(seed), every) for seed_step, seed in [(0, 0), *STEPS.items()]}
    write_reference(paths, pairs, expected[0])
    recipe = {"name": "dpo", "train": {"mode": "dpo", "dpo": {"beta": BETA}}, "code_version": "test"}
    paths.recipe.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    for step, seed in STEPS.items():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = build_accelerator(TrainConfig(micro_batch_size=3))
        score_preference_pairs(model_of(seed), paths, 3, accelerator, step, ("checkpoint-fp", "task-fp"), SETTINGS)
    return ScoredRun(run_dir, pairs, expected)
