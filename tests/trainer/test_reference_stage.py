"""trainer/preference/reference_stage.py: the reference log-probs of each (split, preference source) are computed once,
equal each pair's log-probs alone under the base model, are skipped on a re-run, and are recomputed (``tokenmill
status`` says why) when the base model or the shards change; the trainer refuses values of another model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from core.code_trust import NO_CODE
from core.rundir import RunPaths
from core.shards.store import read_shard_index, write_shard_index
from core.stage import run_stage, stage_status
from flows.recipe import RunRecipe
from flows.stage_list import TRAIN_STAGES
from tests.trainer.conftest import Corpus
from tests.trainer.preference_run import make_preference_run_dir
from trainer.loader.batches import PAD_ID, SplitRows
from trainer.loader.pair_rows import PairRows
from trainer.preference.pair_batch import pad_pairs, pair_logps
from trainer.preference.reference_stage import ReferenceStage
from trainer.preference.reference_store import StoredLogps, read_reference_logps, reference_model_sha256
from trainer.train import main
from trainer.train_stage import TrainStage

UNITS = ["split=train/source=email", "split=train/source=web", "split=val/source=email", "split=val/source=web"]


def resolved(run_dir: Path) -> SimpleNamespace:
    """What a flow hands the stages' ``build``: the recipe (run.yaml), the paths, the trust."""
    recorded = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe = RunRecipe.model_validate({key: value for key, value in recorded.items() if key != "code_version"})
    return SimpleNamespace(recipe=recipe, paths=RunPaths(run_dir), trust=NO_CODE)


def perturb_base_model(run_dir: Path) -> None:
    """Another reference model: one weight of base_model/ changed (as re-exporting another SFT model would)."""
    path = run_dir / "base_model" / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def test_stored_values_are_each_pairs_log_probs_alone_under_the_base_model(tmp_path: Path,
                                                                            stdlib_corpus: Corpus) -> None:
    from transformers import AutoModelForCausalLM

    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus)
    paths = RunPaths(run_dir)
    sha256 = reference_model_sha256(paths.base_model)
    model = AutoModelForCausalLM.from_pretrained(paths.base_model, dtype=torch.float32).eval()
    rows = SplitRows(run_dir, "val", PAD_ID, mode="dpo", source="web")
    micro = PairRows(rows).micro_batch(np.arange(rows.num_rows))
    stored = StoredLogps(read_reference_logps(paths.reference_logps("val", "web"), sha256))
    assert len(stored) == micro.num_pairs == 12
    chosen, rejected = stored.lookup(micro.keys)
    with torch.no_grad():  # each pair alone, one padded row per side (not the shards' packed rows)
        alone = pair_logps(model, pad_pairs(unpacked_pairs(micro), pad_id=PAD_ID))
    np.testing.assert_allclose(chosen, alone.chosen.numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(rejected, alone.rejected.numpy(), rtol=0, atol=1e-5)


def unpacked_pairs(micro: object) -> list[object]:
    """The micro-batch's pairs cut out of its packed rows, each side's tokens and loss mask, in pair order."""
    from tokenization.chat.masks import MaskedConversation
    from tokenization.preference.masks import MaskedPair

    batch = micro.batch
    sides = []
    for side in range(2 * batch.num_pairs):
        where = batch.sequence_ids == side
        row = int(where.any(dim=1).nonzero()[0])
        sides.append(MaskedConversation(batch.input_ids[row][where[row]].tolist(),
                                        batch.loss_mask[row][where[row]].tolist(), "prefix_diff"))
    return [MaskedPair(sides[k], sides[batch.num_pairs + k], 1) for k in range(batch.num_pairs)]


def test_a_rerun_skips_and_a_changed_base_model_or_shard_recomputes_and_status_says_why(
        tmp_path: Path, stdlib_corpus: Corpus, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, max_steps=1, eval_every=1, checkpoint_every=1)
    run = resolved(run_dir)
    stage = ReferenceStage.build(run)
    train = TrainStage.build(run)
    assert TRAIN_STAGES.index(ReferenceStage) < TRAIN_STAGES.index(TrainStage) and "reference" in train.reads
    assert stage.units() == UNITS
    assert all(run_stage(stage, unit).skipped for unit in UNITS)
    assert {stage_status(stage, unit).state for unit in UNITS} == {"done"}
    read_before = train.inputs(None).digests()["upstream:reference"]

    perturb_base_model(run_dir)
    statuses = [stage_status(stage, unit) for unit in UNITS]
    assert {status.state for status in statuses} == {"stale"}
    assert all(status.reasons == ("file changed: reference_model",) for status in statuses)
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 2  # the trainer never trains on another model's values
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "computed with reference model" in err and "recompute" in err

    assert not any(run_stage(stage, unit).skipped for unit in UNITS)
    assert train.inputs(None).digests()["upstream:reference"] != read_before  # so the train stage re-runs
    assert read_reference_logps(RunPaths(run_dir).reference_logps("train", "web"), stage.reference_sha256())
    assert main(["--run-dir", str(run_dir)]) == 0

    drop_last_row(run_dir, "shards/split=train/source=email/part-00000.arrow")
    statuses = {unit: stage_status(stage, unit) for unit in UNITS}
    assert statuses[UNITS[0]].reasons == ("file changed: shards/split=train/source=email/part-00000.arrow",)
    assert {unit for unit, status in statuses.items() if status.state == "done"} == set(UNITS) - {UNITS[0]}


def drop_last_row(run_dir: Path, relpath: str) -> None:
    """Rewrite one preference shard without its last row (new bytes), and the index with its new sha256."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from core.shards.chat import ChatRows, write_chat_shard
    from core.shards.store import ShardRows

    infos = {info.path: info for info in read_shard_index(run_dir)}
    info = infos[relpath]
    with pa.memory_map(str(run_dir / relpath)) as source:
        table = ipc.open_file(source).read_all().slice(0, infos[relpath].num_rows - 1)
        metadata = table.schema.metadata
    seq_len = info.seq_len
    tokens = table.column("input_ids").combine_chunks().flatten().to_numpy().reshape(-1, seq_len)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().reshape(-1, seq_len)
    rows = ShardRows(tokens, *(table.column(name).to_pylist() for name in ("doc_ids", "doc_starts",
                                                                           "first_doc_offset", "num_tokens")))
    infos[relpath] = write_chat_shard(run_dir, relpath, ChatRows(rows, mask), split=info.split, source=info.source,
                                      tokenizer_sha256=info.tokenizer_sha256,
                                      vocab_size=int(metadata[b"vocab_size"]), records="preference")
    write_shard_index(run_dir, list(infos.values()))
