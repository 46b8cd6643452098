"""trainer/loader/document_mask.py and ``train.document_masking``: packed documents are scored as if each were alone.

The run dirs here hold short documents (the paragraphs of standard-library files), so most rows pack several.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from core.errors import ConfigError, ShardFormatError
from core.rundir import RunPaths
from core.shards.store import ShardRows, shard_relpath, write_shard
from tests.trainer.conftest import STDLIB, TEST_DIMS, VOCAB_SIZE, Corpus, MakeRunDir, edit_recipe, exported_weights
from tests.trainer.test_hf_models import save_tiny_model, use_hf_model
from trainer.config import ModelDims
from trainer.eval.checkpoint import val_split_task_fingerprint
from trainer.loader.batches import EOS_ID, PAD_ID, SplitRows, make_batch
from trainer.loader.document_mask import ShardDocStarts, document_attention_mask, position_ids
from trainer.metrics.sink import read_metric_rows
from trainer.model.hf_model import build_hf_model, check_document_masking
from trainer.model.llama import ModelShape, build_model
from trainer.model.spec import output_logits
from trainer.train import main

SEQ_LEN = 64
TOLERANCE = {"rtol": 0.0, "atol": 1e-6}
"""fp32 logits of a document packed with others vs alone: the same maths, summed in another order at most (the
largest difference measured was 1.8e-7, logits of order 1)."""


@pytest.fixture(scope="module")
def paragraph_corpus(stdlib_corpus: Corpus) -> Corpus:
    """The ``email`` package's paragraphs (split on blank lines) as documents: a few to tens of tokens each."""
    tokenizer = Tokenizer.from_str(stdlib_corpus.tokenizer_json)
    docs: dict[tuple[str, str], list[np.ndarray]] = {}
    paragraphs = [part for path in sorted((STDLIB / "email").glob("*.py"))
                  for part in path.read_text(encoding="utf-8").split("\n\n") if part.strip()]
    for number, text in enumerate(paragraphs[:3000]):
        ids = [*tokenizer.encode(text, add_special_tokens=False).ids, EOS_ID]
        docs.setdefault(("val" if number % 10 == 3 else "train", "email"), []).append(np.array(ids, dtype=np.int64))
    return Corpus(stdlib_corpus.tokenizer_json, docs)


@pytest.fixture
def packed_rows(make_run_dir: MakeRunDir, paragraph_corpus: Corpus) -> tuple[np.ndarray, list[np.ndarray]]:
    """Eight real train rows with at least three documents each, and their ``doc_starts`` read from the shards."""
    rows = SplitRows(make_run_dir("paragraphs", corpus=paragraph_corpus, seq_len=SEQ_LEN), "train", PAD_ID)
    chosen = [row for row in range(rows.num_rows) if len(rows.doc_starts(np.array([row]))[0]) >= 3][:8]
    assert len(chosen) == 8
    return rows.rows(np.array(chosen)), rows.doc_starts(np.array(chosen))


def documents(starts: np.ndarray, seq_len: int) -> list[tuple[int, int]]:
    """(begin, end) token offsets of each document in a row."""
    ends = [*starts[1:].tolist(), seq_len]
    return list(zip(starts.tolist(), ends, strict=True))


def largest_gap_to_alone(model: torch.nn.Module, tokens: np.ndarray, doc_starts: list[np.ndarray],
                         masked: bool) -> float:
    """Max |logit difference| between each document in its packed row and the same document run alone."""
    batch = make_batch(tokens, PAD_ID, doc_starts=doc_starts if masked else None)
    largest = 0.0
    with torch.no_grad():
        packed = output_logits(model(**batch.model_kwargs(torch.device("cpu"))))
        for row, starts in enumerate(doc_starts):
            for begin, end in documents(starts, tokens.shape[1]):
                alone = output_logits(model(input_ids=batch.input_ids[row:row + 1, begin:end]))[0]
                if masked:
                    torch.testing.assert_close(packed[row, begin:end], alone, **TOLERANCE)
                largest = max(largest, float((packed[row, begin:end] - alone).abs().max()))
    return largest


def test_builtin_model_scores_each_packed_document_as_if_alone(packed_rows: tuple) -> None:
    tokens, doc_starts = packed_rows
    model = build_model(ModelShape(ModelDims(**TEST_DIMS), VOCAB_SIZE, SEQ_LEN), seed=0).eval()
    assert largest_gap_to_alone(model, tokens, doc_starts, masked=True) <= TOLERANCE["atol"]
    # Without the mask the later documents see the earlier ones: the comparison above can fail.
    assert largest_gap_to_alone(model, tokens, doc_starts, masked=False) > 1e-3


HF_TINY = {"llama": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 64, "max_position_embeddings": SEQ_LEN},
           "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": SEQ_LEN}}
"""Llama (rotary positions) and GPT-2 (learned absolute positions: only equal alone if positions restart)."""


@pytest.mark.parametrize("model_type", sorted(HF_TINY))
def test_hf_model_scores_each_packed_document_as_if_alone(packed_rows: tuple, model_type: str) -> None:
    from transformers import AutoConfig

    model = build_hf_model(AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, **HF_TINY[model_type]), 0).eval()
    tokens, doc_starts = packed_rows
    assert largest_gap_to_alone(model, tokens, doc_starts, masked=True) <= TOLERANCE["atol"]
    assert largest_gap_to_alone(model, tokens, doc_starts, masked=False) > 1e-3
    check_document_masking(model)  # the probe the trainer runs accepts it


def test_hf_model_that_ignores_packed_positions_is_refused_naming_the_key() -> None:
    from transformers import AutoConfig

    # OPT builds its causal mask from attention_mask alone (learned absolute positions, no packed-sequence mask).
    config = AutoConfig.for_model("opt", vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32)
    with pytest.raises(ConfigError, match=r"train\.document_masking: model_type 'opt' does not keep packed"):
        check_document_masking(build_hf_model(config, seed=0))


def test_positions_restart_at_each_document_and_the_mask_stays_inside_it() -> None:
    positions = position_ids([np.array([0, 3, 7]), np.array([0])], seq_len=10)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))]
    mask = document_attention_mask(torch.from_numpy(positions))[:, 0]
    allowed = [[key for key in range(10) if mask[0, query, key]] for query in range(10)]
    assert allowed[2] == [0, 1, 2] and allowed[3] == [3] and allowed[6] == [3, 4, 5, 6] and allowed[9] == [7, 8, 9]
    assert torch.equal(mask[1], torch.ones(10, 10, dtype=torch.bool).tril())


@pytest.mark.parametrize(("starts", "fault"), [([[0, 5, 3]], "does not increase within a row"),
                                                ([[2, 5]], "does not start at 0 in row 0"),
                                                ([[0, 9]], "holds 9, outside [0, 8)")])
def test_malformed_doc_starts_are_refused_naming_the_shard(tmp_path: Path, starts: list[list[int]],
                                                           fault: str) -> None:
    relpath = shard_relpath("train", "web", 0)
    rows = ShardRows(np.zeros((1, 8), dtype=np.int64), [[1] * len(starts[0])], starts, [0], [8])
    write_shard(tmp_path, relpath, rows, split="train", source="web", tokenizer_sha256="0" * 64,
                vocab_size=VOCAB_SIZE)
    with pytest.raises(ShardFormatError, match=re.escape(f"part-00000.arrow: doc_starts {fault}")):
        ShardDocStarts(tmp_path / relpath, seq_len=8)


SETTINGS = {"max_steps": 6, "checkpoint_every": 2, "eval_every": 3, "log_every": 1, "document_masking": True}


def test_masked_training_resumes_bitwise_and_differs_from_unmasked(make_run_dir: MakeRunDir,
                                                                   paragraph_corpus: Corpus) -> None:
    straight = make_run_dir("straight", train=SETTINGS, corpus=paragraph_corpus, seq_len=SEQ_LEN)
    resumed = make_run_dir("resumed", train=SETTINGS, corpus=paragraph_corpus, seq_len=SEQ_LEN)
    unmasked = make_run_dir("unmasked", train={**SETTINGS, "document_masking": False}, corpus=paragraph_corpus,
                            seq_len=SEQ_LEN)
    for run_dir in (straight, unmasked):
        assert main(["--run-dir", str(run_dir)]) == 0
    assert main(["--run-dir", str(resumed), "--until-step", "3"]) == 0
    assert main(["--run-dir", str(resumed)]) == 0
    straight_weights, resumed_weights = exported_weights(straight), exported_weights(resumed)
    assert all(torch.equal(straight_weights[name], resumed_weights[name]) for name in straight_weights)
    losses = {run: [row["loss"] for row in read_metric_rows(run / "metrics" / "train.jsonl")]
              for run in (straight, resumed, unmasked)}
    assert losses[straight] == losses[resumed]
    assert losses[straight][0] != losses[unmasked][0]  # the same first batch, scored with and without the mask
    val_losses = {run: read_metric_rows(run / "metrics" / "eval.jsonl")[0]["val_loss"] for run in (straight, unmasked)}
    assert val_losses[straight] != val_losses[unmasked]  # the step-0 evaluation is masked too


def test_hf_llama_trains_with_document_masking(tmp_path: Path, make_run_dir: MakeRunDir,
                                               paragraph_corpus: Corpus) -> None:
    run_dir = make_run_dir("hf", train={**SETTINGS, "max_steps": 2}, corpus=paragraph_corpus, seq_len=SEQ_LEN)
    use_hf_model(run_dir, save_tiny_model(tmp_path / "llama", "llama", max_position_embeddings=SEQ_LEN))
    assert main(["--run-dir", str(run_dir)]) == 0
    assert [row["step"] for row in read_metric_rows(run_dir / "metrics" / "train.jsonl")] == [1, 2]


def test_opt_with_document_masking_stops_with_one_line(tmp_path: Path, make_run_dir: MakeRunDir,
                                                       paragraph_corpus: Corpus,
                                                       capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoConfig

    run_dir = make_run_dir("opt", train=SETTINGS, corpus=paragraph_corpus, seq_len=SEQ_LEN)
    AutoConfig.for_model("opt", vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         ffn_dim=64, word_embed_proj_dim=32).save_pretrained(tmp_path / "opt")
    use_hf_model(run_dir, tmp_path / "opt")
    assert main(["--run-dir", str(run_dir)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "train.document_masking: model_type 'opt'" in error[0]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_whole_split_scores_are_keyed_by_the_masking(make_run_dir: MakeRunDir) -> None:
    paths = RunPaths(make_run_dir("keyed"))
    unmasked = val_split_task_fingerprint(paths, "fp32")
    edit_recipe(paths.root, "train", document_masking=True)
    assert val_split_task_fingerprint(paths, "fp32") != unmasked
