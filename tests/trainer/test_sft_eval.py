"""Evaluation of a supervised fine-tuning run: the val split's loss is over the trained tokens only (the chat shards'
``loss_mask``), per source, and says so; the downstream tasks go through the chat template.

Chat shards are written with the shard writer the SFT data stage uses (:func:`core.shards.chat.write_chat_shard`),
with random tokens and masks: the scores are checked against a loss computed by hand over the masked labels.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from core.eval_results import VAL_SPLIT_TASK, describe, read_result
from core.files.atomic import sha256_file
from core.rundir import RunPaths
from core.shards.chat import ChatRows, write_chat_shard
from core.shards.store import ShardRows, shard_relpath, write_shard, write_shard_index
from tests.conftest import STDLIB
from tests.trainer.conftest import VOCAB_SIZE, MakeRunDir, fresh_accelerator
from tokenization.train_tokenizer import train_tokenizer
from trainer.config import EvalConfig, ModelDims, TrainConfig
from trainer.eval.checkpoint import score_val_split, val_split_task_fingerprint
from trainer.eval.downstream import run_downstream_task
from trainer.eval.evaluate import Evaluator
from trainer.eval.run_mode import is_sft, scored_tokens, train_mode
from trainer.eval.stages import DownstreamStage, EvalScope, ValSplitStage
from trainer.loader.batches import ArrayRows, SplitRows
from trainer.model.llama import IGNORE_INDEX, ModelShape, build_model, next_token_loss

SEQ_LEN = 24
DIMS = ModelDims(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


def random_chat_rows(rng: np.random.Generator, num_rows: int, vocab_size: int) -> ChatRows:
    """Rows of two conversations each (starts 0 and 10), padded after 20 tokens, about half the tokens trained."""
    tokens = rng.integers(2, vocab_size, size=(num_rows, SEQ_LEN))
    tokens[:, 20:] = 1
    mask = (rng.random((num_rows, SEQ_LEN)) < 0.5).astype(np.uint8)
    mask[:, [0, 10]] = 0  # a conversation's first token is never a target
    mask[:, 20:] = 0
    rows = ShardRows(tokens, [[2 * row, 2 * row + 1] for row in range(num_rows)], [[0, 10]] * num_rows,
                     [0] * num_rows, [20] * num_rows)
    return ChatRows(rows, mask)


def masked_mean_loss(model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray) -> tuple[float, int]:
    """By hand: the mean next-token loss over the positions whose mask is 1 (one forward, no document masking)."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    labels = torch.where(torch.from_numpy(mask.astype(bool)), ids, IGNORE_INDEX)
    with torch.no_grad():
        loss_sum = next_token_loss(model(ids), labels, reduction="sum").item()
    num_tokens = int(mask[:, 1:].sum())
    return loss_sum / num_tokens, num_tokens


WRITTEN_VAL_MASKS: list[np.ndarray] = []
"""The val shards' masks as the fixture wrote them, in index order (the expectation SplitLossMasks must meet)."""


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir with a tokenizer tokenmill trained and chat shards: train (one source) and val (two sources, the
    second in two shards)."""
    run_dir = tmp_path_factory.mktemp("sft-run")
    tokenizer = train_tokenizer([path.read_text() for path in sorted((STDLIB / "json").glob("*.py"))], 300)
    paths = RunPaths(run_dir)
    paths.tokenizer.parent.mkdir(parents=True)
    tokenizer.save(str(paths.tokenizer))
    digest, vocab_size = sha256_file(paths.tokenizer), tokenizer.get_vocab_size()
    rng = np.random.default_rng(0)
    shards = [("train", "qa", 0, 8), ("val", "qa", 0, 5), ("val", "tools", 0, 3), ("val", "tools", 1, 4)]
    infos = []
    for split, source, part, num_rows in shards:
        chat = random_chat_rows(rng, num_rows, vocab_size)
        infos.append(write_chat_shard(run_dir, shard_relpath(split, source, part), chat, split=split, source=source,
                                      tokenizer_sha256=digest, vocab_size=vocab_size))
        if split == "val":
            WRITTEN_VAL_MASKS.append(chat.loss_mask)
    write_shard_index(run_dir, infos)
    return run_dir


def val_rows_and_masks(run_dir: Path) -> tuple[SplitRows, np.ndarray]:
    """The val rows and, row by row, the masks the fixture wrote."""
    return SplitRows(run_dir, "val", pad_id=1, mode="sft"), np.concatenate(WRITTEN_VAL_MASKS)


def test_the_loss_masks_are_each_rows_own_across_shards(chat_run: Path) -> None:
    rows, expected = val_rows_and_masks(chat_run)
    order = np.array([11, 0, 7, 5, 8, 4])  # rows of three shards, out of order
    assert np.array_equal(rows.loss_mask(order), expected[order])
    assert expected.shape == (12, SEQ_LEN) and expected[:, 20:].sum() == 0 and expected.sum() > 40


def test_a_pretraining_shard_has_no_loss_mask_and_is_named(tmp_path: Path, chat_run: Path) -> None:
    tokens = np.arange(2 * SEQ_LEN).reshape(2, SEQ_LEN) % 50 + 2
    relpath = shard_relpath("val", "text", 0)
    info = write_shard(tmp_path, relpath, ShardRows(tokens, [[0], [1]], [[0], [0]], [0, 0], [SEQ_LEN] * 2),
                       split="val", source="text", tokenizer_sha256="t", vocab_size=300)
    write_shard_index(tmp_path, [info])
    with pytest.raises(ConfigError, match=r"part-00000\.arrow: a token shard \(no loss_mask column\)"):
        SplitRows(tmp_path, "val", pad_id=1, mode="sft")


def test_the_evaluator_scores_only_the_masked_tokens() -> None:
    rng = np.random.default_rng(1)
    chat = random_chat_rows(rng, 6, 64)
    model = build_model(ModelShape(DIMS, 64, SEQ_LEN), seed=0).eval()
    masks = chat.loss_mask

    def evaluate(loss_mask: np.ndarray | None) -> dict[str, float]:
        rows = ArrayRows(chat.rows.input_ids, pad_id=1, loss_mask=loss_mask)
        return Evaluator(rows, 4, None, fresh_accelerator()).evaluate(model)

    expected_loss, expected_tokens = masked_mean_loss(model, chat.rows.input_ids, masks)
    scores = evaluate(masks)
    assert scores["val_tokens"] == expected_tokens
    assert scores["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
    every_token = evaluate(None)
    assert every_token["val_tokens"] > expected_tokens and every_token["val_loss"] != pytest.approx(expected_loss)


def test_the_whole_split_is_scored_on_trained_tokens_per_source_and_labelled(chat_run: Path) -> None:
    paths = RunPaths(chat_run)
    rows, masks = val_rows_and_masks(chat_run)
    tokens = rows.rows(np.arange(rows.num_rows))
    model = build_model(ModelShape(DIMS, 300, SEQ_LEN), seed=0).eval()
    train = TrainConfig(micro_batch_size=4, mode="sft", document_masking=False)
    score_val_split(model, paths, train, fresh_accelerator(train), 4, "task-fp", "checkpoint-fp", "assistant")
    result = read_result(paths.eval_result(4, VAL_SPLIT_TASK))
    assert result["status"] == "ok" and result["scored_tokens"] == "assistant"
    values = {(row["metric"], row["source"]): row["value"] for row in result["rows"]}
    for source, selected in (("qa", slice(0, 5)), ("tools", slice(5, 12)), (None, slice(0, 12))):
        loss, _ = masked_mean_loss(model, tokens[selected], masks[selected])
        assert values[("loss", source)] == pytest.approx(loss, rel=1e-6), source
    assert values[("tokens", None)] == int(masks[:, 1:].sum())
    assert describe(result).startswith("val_split @ step 4 (loss on assistant tokens): {\"loss\": ")


def test_a_pretraining_result_has_no_label(make_run_dir: MakeRunDir) -> None:
    paths = RunPaths(make_run_dir())
    model = build_model(ModelShape(DIMS, VOCAB_SIZE, 64), seed=0).eval()
    train = TrainConfig(micro_batch_size=4)
    score_val_split(model, paths, train, fresh_accelerator(train), 8, "task-fp", "checkpoint-fp")
    result = read_result(paths.eval_result(8, VAL_SPLIT_TASK))
    assert "scored_tokens" not in result and "chat_template" not in result
    assert describe(result).startswith("val_split @ step 8: ")


def test_trained_token_scores_have_their_own_fingerprint(chat_run: Path) -> None:
    paths = RunPaths(chat_run)
    plain = val_split_task_fingerprint(paths, "fp32", False, sft=False)
    assert val_split_task_fingerprint(paths, "fp32", False, sft=True) != plain
    assert val_split_task_fingerprint(paths, "fp32", True, sft=True) not in (
        plain, val_split_task_fingerprint(paths, "fp32", True, sft=False))


def test_the_mode_is_read_with_a_default_and_the_label_only_from_known_values() -> None:
    assert train_mode(TrainConfig()) == "pretrain" and not is_sft(TrainConfig())
    assert is_sft(SimpleNamespace(mode="sft")) and not is_sft(SimpleNamespace(mode="pretrain"))
    assert scored_tokens({}) == "assistant" == scored_tokens({"chat": {"template_file": "t.jinja"}})
    assert scored_tokens({"chat": {"loss": "last_assistant"}}) == "last_assistant"
    assert scored_tokens({"chat": {"loss": "[red]{{ 7 * 7 }}"}}) == "loss_mask"
    assert scored_tokens({"chat": "nonsense"}) == "assistant"
    forged = {"task": "val_split", "step": 1, "status": "ok", "rows": [], "scored_tokens": "[bold]x"}
    assert describe(forged) == "val_split @ step 1: {}", "a result file is data: an unknown label is not shown"


@pytest.mark.parametrize("sft", [False, True])
def test_an_sft_scope_changes_the_units_inputs_and_a_pretraining_one_does_not(tmp_path: Path, sft: bool) -> None:
    paths = RunPaths(tmp_path)
    scope = EvalScope((4,), True, {"qa": "task-fp"}, EvalConfig(), "fp32", False, sft=sft)
    downstream = DownstreamStage(paths, scope).inputs("step-0000004/qa").settings
    val_split = ValSplitStage(paths, scope).inputs("step-0000004").settings
    if sft:
        assert downstream["chat_template"] is True and val_split["scored_tokens"] == "trained"
    else:  # as before SFT existed: a pretraining run's evaluation is not redone
        assert set(downstream) == {"task", "batch_size", "limit"}
        assert set(val_split) == {"precision", "document_masking"}


def test_a_downstream_task_of_an_sft_run_needs_the_exports_chat_template(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    result = run_downstream_task(RunPaths(tmp_path), model, 4, "qa", "checkpoint-fp", "task-fp", [], EvalConfig(),
                                 chat_template=True)
    assert result["status"] == "failed" and result["chat_template"] is True
    assert result["error"].startswith(f"model folder {model} has no chat template (chat_template.jinja or ")
