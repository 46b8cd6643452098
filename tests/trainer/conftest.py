"""Trainer fixtures: a small real run dir (BPE-tokenised standard-library source, packed into Arrow shards)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from core.files.atomic import sha256_file
from core.shards.store import ShardRows, shard_relpath, write_shard, write_shard_index
from trainer.config import TrainConfig
from trainer.loader.batches import EOS_ID, PAD_ID
from trainer.metrics.sink import read_metric_rows
from trainer.parallel.accelerator import build_accelerator

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = {"email": ("email",), "web": ("json", "http")}
"""Two sources (folders of the standard library each)."""
VOCAB_SIZE = 512
SEQ_LEN = 64
ROWS_PER_SHARD = 600
TEST_DIMS = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}
"""A 4-head / 2-kv-head model (so GQA is exercised) that trains a step in milliseconds."""
TEST_TRAIN = {"max_steps": 8, "micro_batch_size": 4, "grad_accum_steps": 1, "lr": 3e-3, "warmup_steps": 2,
              "checkpoint_every": 4, "eval_every": 4, "eval_batches": 2, "log_every": 2, "keep_last": 2, "seed": 0}


@dataclass(frozen=True)
class Corpus:
    """Tokenised documents per (split, source) and the tokenizer that made them."""

    tokenizer_json: str
    docs: dict[tuple[str, str], list[np.ndarray]]
    pad_id: int = PAD_ID


def _read_texts(packages: tuple[str, ...]) -> list[str]:
    files = [path for package in packages for path in sorted((STDLIB / package).rglob("*.py"))]
    return [path.read_text(encoding="utf-8") for path in files]


def _train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


@pytest.fixture(scope="session")
def stdlib_corpus() -> Corpus:
    """Every 10th file of each source is validation; the BPE is trained on the train files only."""
    texts = {source: _read_texts(packages) for source, packages in SOURCES.items()}
    split_of = {source: ["val" if i % 10 == 3 else "train" for i in range(len(t))] for source, t in texts.items()}
    tokenizer = _train_tokenizer([t for s, ts in texts.items() for t, sp in zip(ts, split_of[s], strict=True)
                                  if sp == "train"])
    docs: dict[tuple[str, str], list[np.ndarray]] = {}
    for source, source_texts in texts.items():
        for text, split in zip(source_texts, split_of[source], strict=True):
            ids = [*tokenizer.encode(text, add_special_tokens=False).ids, EOS_ID]
            docs.setdefault((split, source), []).append(np.array(ids, dtype=np.int64))
    return Corpus(tokenizer.to_str(), docs)


def pack_rows(docs: list[np.ndarray], seq_len: int, first_doc_id: int, pad_id: int = PAD_ID) -> ShardRows:
    """Concatenate documents and cut rows of ``seq_len``; the last row is padded with ``pad_id``."""
    stream = np.concatenate(docs)
    starts = np.concatenate([[0], np.cumsum([len(doc) for doc in docs])])
    num_rows = -(-len(stream) // seq_len)
    padded = np.full(num_rows * seq_len, pad_id, dtype=np.int64)
    padded[:len(stream)] = stream
    doc_ids, doc_starts, offsets, num_tokens = [], [], [], []
    for row in range(num_rows):
        lo, hi = row * seq_len, min((row + 1) * seq_len, len(stream))
        first = int(np.searchsorted(starts, lo, side="right") - 1)
        last = int(np.searchsorted(starts, hi - 1, side="right") - 1)
        doc_ids.append([first_doc_id + d for d in range(first, last + 1)])
        doc_starts.append([max(int(starts[d]) - lo, 0) for d in range(first, last + 1)])
        offsets.append(lo - int(starts[first]))
        num_tokens.append(hi - lo)
    return ShardRows(padded.reshape(num_rows, seq_len), doc_ids, doc_starts, offsets, num_tokens)


def write_corpus_shards(run_dir: Path, corpus: Corpus, seq_len: int) -> None:
    """Write shards (several per train source) and the index the way the pack stage lays them out."""
    tokenizer_path = run_dir / "tokenizer" / "tokenizer.json"
    tokenizer_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_path.write_text(corpus.tokenizer_json, encoding="utf-8")
    tokenizer_sha = sha256_file(tokenizer_path)
    infos = []
    for number, ((split, source), docs) in enumerate(sorted(corpus.docs.items())):
        rows = pack_rows(docs, seq_len, first_doc_id=number * 10_000, pad_id=corpus.pad_id)
        for part, lo in enumerate(range(0, len(rows), ROWS_PER_SHARD)):
            chunk = slice(lo, lo + ROWS_PER_SHARD)
            part_rows = ShardRows(rows.input_ids[chunk], rows.doc_ids[chunk], rows.doc_starts[chunk],
                                  rows.first_doc_offset[chunk], rows.num_tokens[chunk])
            infos.append(write_shard(run_dir, shard_relpath(split, source, part), part_rows, split=split,
                                     source=source, tokenizer_sha256=tokenizer_sha, vocab_size=VOCAB_SIZE))
    write_shard_index(run_dir, infos)


def write_recipe(run_dir: Path, train: dict[str, Any], dims: dict[str, Any], seq_len: int) -> None:
    """A run.yaml like the flow records it (only ``model`` and ``train`` matter to the trainer)."""
    recipe = {"name": run_dir.name, "data": {"manifests": ["unused.yaml"]}, "pack": {"seq_len": seq_len},
              "model": {"preset": None, "dims": dims}, "train": train, "code_version": "test"}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")


MakeRunDir = Callable[..., Path]


@pytest.fixture
def make_run_dir(tmp_path: Path, stdlib_corpus: Corpus) -> MakeRunDir:
    """Factory: ``make_run_dir(name, train={...overrides}, dims={...overrides})`` -> a ready run dir."""

    def make(name: str = "run", train: dict[str, Any] | None = None, dims: dict[str, Any] | None = None,
             seq_len: int = SEQ_LEN, corpus: Corpus | None = None) -> Path:
        run_dir = tmp_path / name
        run_dir.mkdir(parents=True)
        write_corpus_shards(run_dir, corpus or stdlib_corpus, seq_len)
        write_recipe(run_dir, {**TEST_TRAIN, **(train or {})}, {**TEST_DIMS, **(dims or {})}, seq_len)
        return run_dir

    return make


def fresh_accelerator(train: TrainConfig | None = None) -> Accelerator:
    """A new Accelerator with Accelerate's process-wide singletons reset (each test gets clean state)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return build_accelerator(train or TrainConfig(**TEST_TRAIN))


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> None:
    """trainer.train builds its own Accelerator; start every test from a clean process-wide state."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def metric_steps(run_dir: Path, name: str) -> list[int]:
    """Steps of the rows in ``metrics/<name>``."""
    return [row["step"] for row in read_metric_rows(run_dir / "metrics" / name)]


def exported_weights(run_dir: Path) -> dict[str, Any]:
    """The exported model's tensors by name."""
    return load_file(run_dir / "model" / "model.safetensors")


def edit_recipe(run_dir: Path, section: str, **changes: object) -> None:
    """Change keys of one section of ``run.yaml`` (as a user editing the recipe between runs)."""
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe[section] = {**(recipe.get(section) or {}), **changes}
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))
