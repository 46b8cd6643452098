"""``train.mode: sft``: chat shards' loss masks become the labels, a step's loss is the mean over all its trained tokens
(whatever the micro-batches and ranks), the trained tokens are logged, and each mode refuses the other's shards."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from tests.trainer.chat_run import make_chat_run_dir
from tests.trainer.conftest import Corpus, MakeRunDir, edit_recipe
from tests.trainer.test_precision import build_loop
from trainer.config import TrainConfig
from trainer.eval.evaluate import fixed_subset
from trainer.loader.batches import PAD_ID, BatchLayout, SplitRows, TrainLoader
from trainer.metrics.sink import read_metric_rows
from trainer.model.llama import IGNORE_INDEX, next_token_loss
from trainer.model.spec import output_logits
from trainer.train import main


def shard_masks(rows: SplitRows, row_ids: np.ndarray) -> np.ndarray:
    """The rows' loss_mask read straight from the shard files (not through the loader)."""
    shard_ids, local = rows.locate(row_ids)
    out = []
    for shard_id, row in zip(shard_ids.tolist(), local.tolist(), strict=True):
        with pa.memory_map(str(rows.shards[shard_id].path)) as source:
            out.append(ipc.open_file(source).read_all().column("loss_mask")[row].as_py())
    return np.array(out, dtype=np.int64)


def test_sft_labels_are_the_loss_mask_and_positions_restart_per_conversation(tmp_path: Path,
                                                                            stdlib_corpus: Corpus) -> None:
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, model_type=None)
    assert TrainConfig(mode="sft").document_masking  # on by default: packed conversations must not see each other
    rows = SplitRows(run_dir, "train", PAD_ID, mode="sft")
    ranks = [TrainLoader(rows, BatchLayout(2, 2, 2, rank), seed=3, document_masking=True) for rank in (0, 1)]
    step_rows = ranks[0].next_steps_rows(1)[0]
    ranks[0].samples_consumed = 0
    counts = []
    for rank, loader in enumerate(ranks):
        batches = loader.next_step()
        ids = torch.cat([batch.input_ids for batch in batches]).numpy()
        masks = shard_masks(rows, step_rows[rank])
        expected = np.where(masks == 1, ids, IGNORE_INDEX)
        assert np.array_equal(torch.cat([batch.labels for batch in batches]).numpy(), expected)
        positions = torch.cat([batch.position_ids for batch in batches]).numpy()
        for row, starts in enumerate(rows.doc_starts(step_rows[rank])):
            assert (positions[row, starts] == 0).all() and len(starts) == (positions[row] == 0).sum()
        counts.append(int((expected[:, 1:] != IGNORE_INDEX).sum()))
    assert counts[0] != counts[1]  # the ranks hold different numbers of trained tokens ...
    assert ranks[0].step_loss_tokens == ranks[1].step_loss_tokens == sum(counts)  # ... and both know the step's


def test_each_mode_refuses_the_other_kind_of_shard_in_one_line(tmp_path: Path, stdlib_corpus: Corpus,
                                                               make_run_dir: MakeRunDir,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    text_run = make_run_dir("text", train={"mode": "sft"})
    assert main(["--run-dir", str(text_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {text_run}/shards/split=train/") and "a token shard (no loss_mask column), " \
        "but train.mode is sft" in err and "set train.mode: pretrain" in err

    chat_run = make_chat_run_dir(tmp_path, stdlib_corpus, model_type=None)
    edit_recipe(chat_run, "train", mode="pretrain", document_masking=False)
    assert main(["--run-dir", str(chat_run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {chat_run}/shards/split=train/") and "a chat shard" in err \
        and "set train.mode: sft" in err


def test_sft_without_document_masking_refuses_rows_of_several_conversations(
        tmp_path: Path, stdlib_corpus: Corpus, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, model_type=None, document_masking=False)
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {run_dir}/shards/split=")
    assert "conversations and train.document_masking is false, so they would attend to each other" in err


def test_an_sft_steps_loss_and_gradients_are_the_mean_over_all_its_trained_tokens(tmp_path: Path,
                                                                                   stdlib_corpus: Corpus) -> None:
    """Micro-batches with different numbers of trained tokens: every token weighs the same (not a mean of means)."""
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, model_type=None, micro_batch_size=2, grad_accum_steps=3)
    loop = build_loop(run_dir)
    model = loop.accelerator.unwrap_model(loop.model)
    reference = copy.deepcopy(model)
    batches = loop.loader.next_step()
    per_batch = [int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch in batches]
    assert len(set(per_batch)) > 1 and loop.loader.step_loss_tokens == sum(per_batch)
    loss = float(loop.forward_backward(batches, loop.loader.step_loss_tokens))

    logits = output_logits(reference(input_ids=torch.cat([b.input_ids for b in batches]),
                                     position_ids=torch.cat([b.position_ids for b in batches])))
    expected = next_token_loss(logits, torch.cat([b.labels for b in batches]))  # one mean over every target
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    for (name, param), (_, twin) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(param.grad, twin.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_an_sft_run_logs_its_trained_tokens_and_scores_val_on_them_only(tmp_path: Path,
                                                                         stdlib_corpus: Corpus) -> None:
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, max_steps=3, log_every=1, eval_every=3,
                                checkpoint_every=3)
    assert main(["--run-dir", str(run_dir)]) == 0
    rows = SplitRows(run_dir, "train", PAD_ID, mode="sft")
    replay = TrainLoader(rows, BatchLayout(4, 1), seed=0, document_masking=True)
    expected = []
    for _ in range(3):
        replay.next_step()
        expected.append(replay.step_loss_tokens)
    logged = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["loss_tokens"] for row in logged] == expected
    assert [row["loss_tokens_seen"] for row in logged] == np.cumsum(expected).tolist()
    for row, trained in zip(logged, expected, strict=True):  # a step: 4 rows of 64 tokens
        assert row["loss_tokens_per_s"] == pytest.approx(row["tokens_per_s"] * trained / (4 * 64))

    val = SplitRows(run_dir, "val", PAD_ID, mode="sft")
    _, subset, _ = fixed_subset(val, 2 * 4)  # eval_batches * micro_batch_size
    scored = int(shard_masks(val, subset)[:, 1:].sum())
    evals = read_metric_rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["val_tokens"] for row in evals] == [scored, scored]
