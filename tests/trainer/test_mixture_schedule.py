"""trainer/loader/mixture.py schedules: stages switch at the exact step, shares per stage, max_repetition, exact
resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.errors import ConfigError
from tests.trainer.conftest import MakeRunDir
from trainer.loader.batches import PAD_ID, SplitRows
from trainer.loader.mixture import BLOCK_SAMPLES, MixtureExhaustedError, MixtureOrder, MixtureStage
from trainer.train import build_mixture, read_trainer_config

ROWS = {"email": np.arange(0, 3000), "web": np.arange(3000, 3500)}
"""Two sources (3,000 and 500 rows): row number < 3000 means email."""
STAGES = [MixtureStage(15, {"email": 0.25, "web": 0.75}), MixtureStage(30, {"email": 0.75, "web": 0.25}),
          MixtureStage(None, {"email": 1.0})]
BATCH = 100
"""Samples per step: stage 1 ends at sample 1,500, mid-block (blocks hold 1,024)."""


def take_steps(order: MixtureOrder, batches: list[int]) -> np.ndarray:
    """Rows of consecutive steps of the given global batch sizes (as the loader takes them)."""
    return np.concatenate([order.take(order.position, size) for size in batches])


def test_stages_switch_at_the_first_sample_of_the_next_step_and_hold_their_weights() -> None:
    is_web = take_steps(MixtureOrder(ROWS, {}, seed=0, stages=STAGES), [BATCH] * 40) >= 3000
    # Stage 1: steps 1-15 = samples 0-1499. A full block holds its share exactly, the whole stage to within a block.
    assert is_web[:BLOCK_SAMPLES].sum() == 768 and abs(is_web[:1500].mean() - 0.75) < 0.03
    # Stage 2 starts at sample 1500 (step 16) with a fresh block: its first 1,024 samples hold exactly 256 web.
    assert is_web[1500:1500 + BLOCK_SAMPLES].sum() == 256 and abs(is_web[1500:3000].mean() - 0.25) < 0.03
    # Stage 3 (step 31 on) has no web at all; the step before it is still stage 2's.
    assert not is_web[3000:].any() and is_web[2900:3000].any()
    # Several steps in one take (as a replay of a whole launch takes them) switch stages at the same samples.
    in_one_take = MixtureOrder(ROWS, {}, seed=0, stages=STAGES).take(0, 40 * BATCH, num_steps=40) >= 3000
    assert np.array_equal(in_one_take, is_web)


def test_the_mix_column_counts_samples_per_stage_and_source() -> None:
    order = MixtureOrder(ROWS, {}, seed=0, stages=STAGES)
    is_web = take_steps(order, [BATCH] * 16) >= 3000
    counts = {(row["stage"], row["source"]): row["samples"] for row in order.pop_window_counts()}
    assert counts == {(0, "web"): is_web[:1500].sum(), (0, "email"): 1500 - is_web[:1500].sum(),
                      (1, "web"): is_web[1500:].sum(), (1, "email"): BATCH - is_web[1500:].sum()}
    assert order.pop_window_counts() == []  # popped: the next metrics row starts from zero


def test_max_repetition_drops_a_source_before_it_passes_its_epochs_then_stops(recwarn: pytest.WarningsRecorder) -> None:
    stages = [MixtureStage(None, {"email": 0.5, "web": 0.5})]
    order = MixtureOrder(ROWS, {}, seed=0, stages=stages, max_repetition={"web": 2.0, "email": 1.5})
    rows = take_steps(order, [BATCH] * 40)
    # web: 512 samples per block, 1,000 allowed (2 epochs of 500): block 1 would reach 1,024, so web leaves at its
    # first sample, 1,024 = step 11 (samples 1000-1099), and email fills every block from there on.
    assert order.dropped == {"web": 11}
    assert (rows[:BLOCK_SAMPLES] >= 3000).sum() == 512 and not (rows[BLOCK_SAMPLES:] >= 3000).any()
    assert [str(w.message).split(":")[0] for w in recwarn] == ["mixture"]
    assert "'web' dropped from the mix at step 11" in str(recwarn[0].message)
    # email may be seen 4,500 times: it has 512 + 3 * 1,024 = 3,584 at sample 4,096 (in step 41), where the next
    # block would take it to 4,608: nothing is left to train on.
    with pytest.raises(MixtureExhaustedError, match=r"step 41: every source of mixture stage 0 has been seen"):
        take_steps(order, [BATCH] * 10)
    assert order.taken["email"] <= 4500 and order.taken["web"] == 512


@pytest.mark.filterwarnings("ignore:mixture. source 'web' dropped:UserWarning")
@pytest.mark.parametrize(("cut", "max_repetition"), [(14, {}), (15, {}), (16, {}), (10, {"web": 2.0}),
                                                     (11, {"web": 2.0})])
def test_resume_at_or_around_a_boundary_and_a_drop_equals_the_uninterrupted_order(
        cut: int, max_repetition: dict[str, float]) -> None:
    """Saved after step ``cut`` (stage 0 ends at step 15, web is dropped at step 11), then continued with a smaller
    global batch (fewer processes) across the next boundary (step 30)."""
    def order() -> MixtureOrder:
        return MixtureOrder(ROWS, {}, seed=5, stages=STAGES, max_repetition=max_repetition)

    batches = [BATCH] * cut + [60] * 20
    straight = order()
    expected = take_steps(straight, batches)
    first = order()
    head = take_steps(first, batches[:cut])
    resumed = order()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert np.array_equal(np.concatenate([head, take_steps(resumed, batches[cut:])]), expected)
    assert resumed.state_dict() == straight.state_dict()
    assert straight.dropped == ({"web": 11} if max_repetition else {})


def write_schedule(run_dir: Path, schedule: object, mixture: object = None) -> None:
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe.update(mixture_schedule=schedule, mixture=mixture)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))


@pytest.mark.parametrize(("schedule", "mixture", "message"), [
    ({"stages": [{"until_step": 5, "weights": {"web": 1}}, {"until_step": 5, "weights": {"web": 1}}]}, None,
     r"mixture_schedule: stages\[1\]\.until_step: 5 is not after stages\[0\]\.until_step 5"),
    ({"stages": [{"weights": {"web": 1}}, {"until_step": 9, "weights": {"web": 1}}]}, None,
     r"stages\[0\]\.until_step: only the last stage may leave it out"),
    ({"stages": [{"weights": {"web": -1, "email": 1}}]}, None,
     r"mixture_schedule\.stages\.0\.weights\.web: Input should be greater than or equal to 0"),
    ({"stages": [{"weights": {"web": 1}}], "max_repetition": {"wbe": 2}}, None,
     r"max_repetition: source\(s\) \['wbe'\] have no weight in any stage"),
    ({"stages": [{"weights": {"web": 1}}]}, {"web": 1.0}, "mixture and mixture_schedule are both set; keep one"),
])
def test_bad_schedules_are_refused_naming_the_key(make_run_dir: MakeRunDir, schedule: object, mixture: object,
                                                 message: str) -> None:
    run_dir = make_run_dir()
    write_schedule(run_dir, schedule, mixture)
    with pytest.raises(ConfigError, match=message):
        read_trainer_config(run_dir)


def test_a_stage_naming_a_source_without_train_rows_is_refused(make_run_dir: MakeRunDir) -> None:
    run_dir = make_run_dir()
    write_schedule(run_dir, {"stages": [{"until_step": 2, "weights": {"email": 1, "web": 1}},
                                        {"weights": {"email": 1, "web": 1, "books": 1}}]})
    config = read_trainer_config(run_dir)
    with pytest.raises(ConfigError, match=r"run.yaml: mixture_schedule.stages\[1\].weights: no train rows for "
                                          r"source\(s\) \['books'\] \(the train shards hold \['email', 'web'\]\)"):
        build_mixture(SplitRows(run_dir, "train", PAD_ID), None, 0, config.mixture_schedule)
