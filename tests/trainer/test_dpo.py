"""``train.mode: dpo``: a step's loss is DPO's over all its pairs (whatever the micro-batches), stored reference
log-probs train exactly as the reference model on the fly (full and LoRA), SimPO needs no reference, the train and
eval rows carry the rewards, bf16 runs, and each bad combination is refused in one line."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError

from core.errors import ConfigError
from tests.trainer.chat_run import make_chat_run_dir
from tests.trainer.conftest import Corpus, MakeRunDir, edit_recipe
from tests.trainer.preference_run import make_preference_run_dir
from tests.trainer.test_precision import build_loop, record_matmul_dtypes
from trainer.config import TrainConfig
from trainer.loop import TrainingLoop
from trainer.metrics.sink import read_metric_rows
from trainer.preference.dpo_loss import PairLogps, PreferenceLoss, dpo_loss, mean_logps, simpo_loss
from trainer.preference.pair_batch import num_loss_tokens, pair_logps
from trainer.preference.reference_store import PairKey
from trainer.run_config import read_trainer_config
from trainer.train import main

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
STEP = {"micro_batch_size": 2, "grad_accum_steps": 2}


@pytest.fixture(scope="module")
def dpo_template(tmp_path_factory: pytest.TempPathFactory, stdlib_corpus: Corpus) -> Path:
    """One dpo run dir with its reference files, copied by each test that trains (a copy costs milliseconds)."""
    return make_preference_run_dir(tmp_path_factory.mktemp("dpo-template"), stdlib_corpus, **STEP)


def copied(template: Path, tmp_path: Path, name: str = "dpo") -> Path:
    return Path(shutil.copytree(template, tmp_path / name, symlinks=True))


def direct_step(loop: TrainingLoop, reference: torch.nn.Module) -> tuple[float, PreferenceLoss, dict[str, object]]:
    """The loop's next forward/backward (its loss) and DPO over all the step's pairs at once from a copy of the policy
    and ``reference``: returns (the loop's loss, the expected loss, the copy's gradients)."""
    policy = copy.deepcopy(loop.accelerator.unwrap_model(loop.model))
    batches = loop.loader.next_step()
    assert len({micro.num_pairs for micro in batches}) > 1  # the micro-batches hold different numbers of pairs
    assert loop.loader.step_pairs == sum(micro.num_pairs for micro in batches)
    loss = float(loop.forward_backward_pairs(batches, loop.loader.step_pairs))
    with torch.no_grad():
        ref = [pair_logps(reference, micro.batch) for micro in batches]
    own = [pair_logps(policy, micro.batch) for micro in batches]
    expected = dpo_loss(PairLogps(torch.cat([p.chosen for p in own]), torch.cat([p.rejected for p in own])),
                        PairLogps(torch.cat([r.chosen for r in ref]), torch.cat([r.rejected for r in ref])), beta=0.1)
    expected.loss.backward()
    return loss, expected, {name: param.grad for name, param in policy.named_parameters()}


def test_a_dpo_steps_loss_and_gradients_are_dpo_over_all_its_pairs(dpo_template: Path, tmp_path: Path) -> None:
    """Against the reference model read straight from base_model/ (not the stored values), one step after the first
    (where the policy is still the reference and every loss is log 2)."""
    from transformers import AutoModelForCausalLM

    loop = build_loop(copied(dpo_template, tmp_path))
    first = loop.train_step()
    assert first.loss == pytest.approx(math.log(2), abs=1e-6) and first.applied
    assert first.rewards == {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracy": 0.0,
                             "rewards/margin": 0.0}
    reference = AutoModelForCausalLM.from_pretrained(loop_dir(loop) / "base_model", dtype=torch.float32).eval()
    loss, expected, expected_grads = direct_step(loop, reference)
    assert loss == pytest.approx(expected.loss.item(), rel=1e-6)
    assert expected.loss.item() != pytest.approx(math.log(2), abs=1e-4)
    assert loop.step_rewards() == pytest.approx(expected.metrics(), rel=1e-5, abs=1e-7)
    for name, param in loop.accelerator.unwrap_model(loop.model).named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def loop_dir(loop: TrainingLoop) -> Path:
    return loop.checkpointer.paths.root


def trained(run_dir: Path, steps: int = 3) -> tuple[TrainingLoop, list[float], list[dict[str, float]]]:
    loop = build_loop(run_dir)
    results = [loop.train_step() for _ in range(steps)]
    assert all(result.applied for result in results)
    return loop, [result.loss for result in results], [result.rewards for result in results]


def weights(loop: TrainingLoop) -> dict[str, torch.Tensor]:
    return {name: param.detach() for name, param in loop.accelerator.unwrap_model(loop.model).named_parameters()}


@pytest.mark.parametrize(("lora", "precision"), [(None, "fp32"), (LORA, "fp32"), (None, "bf16")],
                         ids=["full", "lora", "bf16"])
def test_stored_reference_log_probs_train_as_the_reference_model_on_the_fly(
        tmp_path: Path, stdlib_corpus: Corpus, lora: dict[str, object] | None, precision: str) -> None:
    """precompute true (the reference stage's files) against false (a frozen copy of the base model; under LoRA the
    policy with its adapters disabled): the same losses, rewards and weights to 1e-5 over three steps. Under bf16
    the reference stage computes under the same autocast as the step (fp32 values would shift every reward)."""
    extra = {"precision": precision} if lora is None else {"lora": lora, "precision": precision}
    stored = make_preference_run_dir(tmp_path, stdlib_corpus, "stored", **STEP, **extra)
    on_the_fly = make_preference_run_dir(tmp_path, stdlib_corpus, "on-the-fly", dpo={"precompute": False}, **STEP,
                                         **extra)
    assert not (on_the_fly / "reference").exists()  # nothing stored: the reference model runs every step
    from_file, file_losses, file_rewards = trained(stored)
    live, live_losses, live_rewards = trained(on_the_fly)
    assert (live.preference.reference.model is None) == (lora is not None)  # LoRA: no second copy of the model
    assert file_losses == pytest.approx(live_losses, abs=1e-5) and len(set(file_losses)) == 3
    for mine, theirs in zip(file_rewards, live_rewards, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    assert file_rewards[-1]["rewards/margin"] != 0.0
    stored_weights, live_weights = weights(from_file), weights(live)
    for name, tensor in stored_weights.items():
        torch.testing.assert_close(tensor, live_weights[name], rtol=0, atol=1e-5, msg=name)


def test_simpo_trains_without_reference_log_probs(tmp_path: Path, stdlib_corpus: Corpus) -> None:
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, dpo={"loss": "simpo", "simpo_gamma": 0.3,
                                                                     "beta": 2.0}, **STEP)
    assert not (run_dir / "reference").exists()
    loop = build_loop(run_dir)
    policy = copy.deepcopy(loop.accelerator.unwrap_model(loop.model))
    batches = loop.loader.next_step()
    loss = float(loop.forward_backward_pairs(batches, loop.loader.step_pairs))
    means = [mean_logps(pair_logps(policy, micro.batch), num_loss_tokens(micro.batch)) for micro in batches]
    expected = simpo_loss(PairLogps(torch.cat([m.chosen for m in means]), torch.cat([m.rejected for m in means])),
                          beta=2.0, gamma=0.3)
    assert loss == pytest.approx(expected.loss.item(), rel=1e-6)
    assert loop.step_rewards() == pytest.approx(expected.metrics(), rel=1e-5)


def test_a_dpo_run_logs_pairs_and_rewards_and_evaluates_val_pairs(dpo_template: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = copied(dpo_template, tmp_path)
    edit_recipe(run_dir, "train", max_steps=2, log_every=1, eval_every=2, checkpoint_every=2)
    assert main(["--run-dir", str(run_dir)]) == 0
    rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1]["pairs_seen"] == rows[0]["pairs"] + rows[1]["pairs"] and rows[0]["pairs"] > 4  # 4 rows a step
    assert rows[0]["rewards/accuracy"] == 0.0 and rows[1]["rewards/margin"] != 0.0
    for row in rows:
        assert row["pairs_per_s"] == pytest.approx(row["tokens_per_s"] * row["pairs"] / (4 * 64))
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin"} <= row.keys()
    evals = read_metric_rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in evals] == [0, 2]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6) and evals[0]["rewards/margin"] == 0.0
    assert evals[1]["val_loss"] != pytest.approx(math.log(2), abs=1e-5) and evals[1]["val_pairs"] > 0
    assert "val_ppl" not in evals[1] and 0.0 <= evals[1]["rewards/accuracy"] <= 1.0
    events = EventAccumulator(str(run_dir / "metrics" / "tensorboard" / "train")).Reload()
    logged = {event.step: event.value for event in events.Scalars("train/rewards/margin")}
    assert logged == pytest.approx({row["step"]: row["rewards/margin"] for row in rows})


def test_bf16_autocast_trains_dpo_on_the_fly(tmp_path: Path, stdlib_corpus: Corpus) -> None:
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, dpo={"precompute": False}, precision="bf16", **STEP)
    loop = build_loop(run_dir)
    matmul_dtypes = record_matmul_dtypes(loop)
    results = [loop.train_step() for _ in range(2)]
    assert all(result.applied and math.isfinite(result.loss) for result in results)
    assert set(matmul_dtypes) == {torch.bfloat16}  # the policy's and the reference's forwards both
    assert all(param.dtype == torch.float32 for param in weights(loop).values())


def test_each_bad_dpo_setting_is_refused_in_one_line() -> None:
    refused = {
        "train.dpo is set but train.mode is sft": {"mode": "sft", "dpo": {}},
        "train.dpo.precompute has no effect with train.dpo.loss simpo": {"dpo": {"loss": "simpo",
                                                                                 "precompute": True}},
        "train.dpo.simpo_gamma has no effect with train.dpo.loss sigmoid": {"dpo": {"simpo_gamma": 1.0}},
        "train.mode dpo needs train.document_masking": {"document_masking": False},
        "train.mode dpo cannot be combined with train.tensor_parallel_size > 1": {"tensor_parallel_size": 2,
                                                                                  "num_processes": 2},
        "train.dpo.precompute false cannot be combined with train.fsdp": {"dpo": {"precompute": False},
                                                                          "fsdp": True, "num_processes": 2},
        "train.lora cannot be combined with train.fsdp": {"lora": LORA, "fsdp": True, "num_processes": 2},
        "train.log_row_losses has no rows to log with train.mode dpo": {"log_row_losses": True},
    }
    for message, settings in refused.items():
        with pytest.raises(ValidationError, match=message):
            TrainConfig(**{"mode": "dpo", **settings})
    recorded = TrainConfig(mode="dpo", dpo={"loss": "simpo"})  # run.yaml records every key: it must read back
    assert TrainConfig.model_validate(recorded.model_dump(mode="json")).dpo.gamma == 0.5
    assert TrainConfig(mode="dpo").dpo.stored_reference and TrainConfig(mode="dpo").document_masking


def test_sigmoid_dpo_without_a_pretrained_model_is_refused_in_one_line(tmp_path: Path, stdlib_corpus: Corpus) -> None:
    run_dir = make_preference_run_dir(tmp_path, stdlib_corpus, model_type=None, references=False)
    with pytest.raises(ConfigError, match=r"train\.mode dpo with train\.dpo\.loss sigmoid needs model\.from_pre"):
        read_trainer_config(run_dir)


def test_each_mode_refuses_the_other_kinds_of_shard_in_one_line(
        tmp_path: Path, stdlib_corpus: Corpus, dpo_template: Path, make_run_dir: MakeRunDir,
        capsys: pytest.CaptureFixture[str]) -> None:
    cases = []
    for mode in ("sft", "pretrain"):
        run_dir = copied(dpo_template, tmp_path, f"as-{mode}")
        edit_recipe(run_dir, "train", mode=mode, dpo=None)
        cases.append((run_dir, f"a preference shard (chosen/rejected pairs), but train.mode is {mode}, which would "
                               "train on the rejected answers too; set train.mode: dpo."))
    chat = make_chat_run_dir(tmp_path, stdlib_corpus, "chat")
    edit_recipe(chat, "train", mode="dpo", document_masking=True)
    cases.append((chat, "a chat shard (conversations, not pairs), but train.mode is dpo"))
    text = make_run_dir("text")
    edit_recipe(text, "train", mode="dpo", dpo={"loss": "simpo"})  # the built-in model: no reference
    cases.append((text, "a token shard (no loss_mask column), but train.mode is dpo"))
    capsys.readouterr()  # the lines of making the run dirs
    for run_dir, message in cases:
        assert main(["--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {run_dir}/shards/split="), err
        assert message in err, err


def test_the_spike_guard_skips_a_dpo_step_whose_pairs_have_corrupted_reference_values(dpo_template: Path,
                                                                                     tmp_path: Path) -> None:
    """The pairs of step 5 get reference log-probs 10^4 nats too high on their chosen side (as a reference file of
    another model would have): that step's loss jumps to ~beta * 10^4 and its update is skipped."""
    run_dir = copied(dpo_template, tmp_path)
    edit_recipe(run_dir, "train", spike_zscore=6.0, spike_window=3)
    corrupt_reference_of_step(run_dir, 5)
    loop = build_loop(run_dir)
    results = [loop.train_step() for _ in range(6)]
    assert [result.spike_z_score is not None for result in results] == [False] * 4 + [True, False]
    assert [result.applied for result in results] == [True] * 4 + [False, True]
    assert results[4].loss > 100 and results[4].rewards["rewards/accuracy"] == 0.0
    assert loop.counters.spike_steps == 1


def corrupt_reference_of_step(run_dir: Path, step: int) -> None:
    """Add 10^4 to the stored chosen reference log-prob of every pair the loader serves at ``step`` (1-based)."""
    from core.rundir import RunPaths
    from trainer.loader.batches import PAD_ID, BatchLayout, SplitRows, TrainLoader
    from trainer.loader.pair_rows import PairRows
    from trainer.preference.reference_store import reference_table, write_reference_logps

    rows = SplitRows(run_dir, "train", PAD_ID, mode="dpo")
    loader = TrainLoader(rows, BatchLayout(STEP["micro_batch_size"], STEP["grad_accum_steps"]), seed=0,
                         document_masking=True, pairs=PairRows(rows))
    for _ in range(step - 1):
        loader.next_step()
    corrupted = {key for micro in loader.next_step() for key in micro.keys}
    paths = RunPaths(run_dir)
    for source in ("email", "web"):
        path = paths.reference_logps("train", source)
        table = pq.read_table(path)
        keys = [PairKey(doc_id, "train", source) for doc_id in table.column("doc_id").to_pylist()]
        chosen = table.column("chosen_logp").to_numpy().copy()
        chosen[[key in corrupted for key in keys]] += 1e4
        write_reference_logps(paths, path, reference_table(keys, chosen, table.column("rejected_logp").to_numpy(),
                                                           table.column("reference_sha256")[0].as_py()))
