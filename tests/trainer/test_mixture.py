"""trainer/loader/mixture.py: weighted source interleave — shares follow the weights, O(1) JSON resume, any world
size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from core.errors import CheckpointError, ConfigError
from flows.run_sql import run_query
from tests.trainer.conftest import SEQ_LEN, Corpus, MakeRunDir, write_corpus_shards
from trainer.loader.batches import PAD_ID, BatchLayout, SplitRows, TrainLoader
from trainer.loader.mixture import BLOCK_SAMPLES, MixtureOrder, block_counts, resolve_weights
from trainer.train import build_mixture, main, read_trainer_config


@pytest.fixture
def train_rows(tmp_path: Path, stdlib_corpus: Corpus) -> SplitRows:
    write_corpus_shards(tmp_path, stdlib_corpus, SEQ_LEN)
    return SplitRows(tmp_path, "train", PAD_ID)


def mixed_loader(rows: SplitRows, weights: dict[str, float], micro: int = 8, accum: int = 1, world: int = 1,
                 rank: int = 0, seed: int = 0) -> TrainLoader:
    return TrainLoader(rows, BatchLayout(micro, accum, world, rank), seed, mixture=build_mixture(rows, weights, seed))


def step_ids(loader: TrainLoader) -> torch.Tensor:
    return torch.cat([batch.input_ids for batch in loader.next_step()])


def source_of_rows(rows: SplitRows) -> np.ndarray:
    """Source name of every global row number."""
    names = np.empty(rows.num_rows, dtype=object)
    for name, row_ids in rows.rows_by_source().items():
        names[row_ids] = name
    return names


def test_block_counts_are_the_weights_to_within_one_sample() -> None:
    counts = block_counts(np.array([0.5, 0.3, 0.2]), 1024)
    assert counts.sum() == 1024 and np.abs(counts - np.array([0.5, 0.3, 0.2]) * 1024).max() < 1
    assert block_counts(np.array([1 / 3] * 3), 10).tolist() == [4, 3, 3]


def test_source_shares_follow_the_weights(train_rows: SplitRows) -> None:
    sizes = {name: len(ids) for name, ids in train_rows.rows_by_source().items()}
    assert sizes["email"] > sizes["web"]  # weights 1:3 turn the larger source into the smaller share
    order = build_mixture(train_rows, {"email": 1.0, "web": 3.0}, seed=0)
    sources = source_of_rows(train_rows)[order.take(0, 5 * BLOCK_SAMPLES + 300)]
    assert (sources[:BLOCK_SAMPLES] == "web").sum() == 768  # exact within every block
    assert (sources == "web").mean() == pytest.approx(0.75, abs=0.01)
    row_share = sizes["web"] / sum(sizes.values())  # what equal weight per row (no mixture section) gives
    assert abs(row_share - 0.75) > 0.2


def test_a_small_heavy_source_repeats_in_fresh_orders(train_rows: SplitRows) -> None:
    web_rows = train_rows.rows_by_source()["web"]
    order = MixtureOrder(train_rows.rows_by_source(), {"web": 0.9, "email": 0.1}, seed=3)
    taken = order.take(0, 3 * len(web_rows))
    web_taken = taken[np.isin(taken, web_rows)]
    first, second = web_taken[:len(web_rows)], web_taken[len(web_rows):2 * len(web_rows)]
    assert sorted(first.tolist()) == sorted(web_rows.tolist()) == sorted(second.tolist())
    assert not np.array_equal(first, second)


def test_order_is_deterministic_and_resumes_from_json_state(train_rows: SplitRows) -> None:
    weights = {"email": 2.0, "web": 1.0}
    straight, again, other = (mixed_loader(train_rows, weights, seed=seed) for seed in (0, 0, 1))
    for _ in range(7):
        batch = step_ids(straight)
        assert torch.equal(batch, step_ids(again)) and not torch.equal(batch, step_ids(other))
    state = json.loads(json.dumps(straight.state_dict()))
    assert state["mixture"]["position"] == 7 * 8 == sum(state["mixture"]["source_samples"].values())
    resumed = mixed_loader(train_rows, weights)
    resumed.load_state_dict(state)
    for _ in range(5):
        assert torch.equal(step_ids(resumed), step_ids(straight))


def test_two_ranks_take_the_same_global_batches_as_one(train_rows: SplitRows) -> None:
    weights = {"email": 1.0, "web": 1.0}
    single = mixed_loader(train_rows, weights, micro=4, accum=2)
    ranks = [mixed_loader(train_rows, weights, micro=4, world=2, rank=rank) for rank in (0, 1)]
    for _ in range(4):
        assert torch.equal(torch.cat([step_ids(rank) for rank in ranks]), step_ids(single))
    assert ranks[0].state_dict() == ranks[1].state_dict()  # every rank counted the whole global batch
    resumed_single = mixed_loader(train_rows, weights, micro=4, accum=2)
    resumed_single.load_state_dict(ranks[1].state_dict())
    assert torch.equal(step_ids(resumed_single), torch.cat([step_ids(rank) for rank in ranks]))


def test_weights_are_checked_against_the_sources() -> None:
    with pytest.raises(ConfigError, match=r"mixture: no weight for source\(s\) \['web'\]"):
        resolve_weights({"email": 1.0}, {"email": 10, "web": 5})
    with pytest.raises(ConfigError, match="sum to 0"):
        resolve_weights({"email": 0.0, "web": 0.0}, {"email": 10, "web": 5})
    with pytest.warns(UserWarning, match=r"\['books'\] have a weight but no train rows"):
        assert resolve_weights({"email": 1.0, "web": 3.0, "books": 2.0}, {"email": 10, "web": 5}) == {
            "email": 0.25, "web": 0.75}
    assert resolve_weights({"email": 0.0, "web": 2.0}, {"email": 10, "web": 5}) == {"web": 1.0}


def write_mixture(run_dir: Path, mixture: dict[str, float] | None) -> None:
    recipe = yaml.safe_load((run_dir / "run.yaml").read_text())
    recipe["mixture"] = mixture
    (run_dir / "run.yaml").write_text(yaml.safe_dump(recipe))


def test_run_yaml_mixture_section_drives_training_and_its_checkpoint(make_run_dir: MakeRunDir,
                                                                     capsys: pytest.CaptureFixture) -> None:
    run_dir = make_run_dir(train={"max_steps": 4, "checkpoint_every": 2})
    write_mixture(run_dir, {"email": -1.0, "web": 1.0})
    with pytest.raises(ConfigError, match=r"mixture\.email: Input should be greater than or equal to 0"):
        read_trainer_config(run_dir)
    write_mixture(run_dir, {"email": 1.0, "web": 1.0})
    assert main(["--run-dir", str(run_dir), "--until-step", "2"]) == 0
    state = json.loads((run_dir / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())
    assert state["states"]["loader"]["mixture"]["position"] == 2 * 4
    assert state["states"]["loader"]["mixture"]["weights"] == {"email": 0.5, "web": 0.5}
    # consumed replays the weighted order: its rows per source are the ones the loader counted while training.
    assert consumed_per_source(run_dir, 1, 2) == state["states"]["loader"]["mixture"]["source_samples"]

    plain = make_run_dir("plain", train={"max_steps": 4, "checkpoint_every": 2})
    assert main(["--run-dir", str(plain), "--until-step", "2"]) == 0
    write_mixture(plain, {"email": 1.0, "web": 1.0})  # a mixture added to a run trained without one
    assert main(["--run-dir", str(plain)]) == 2
    assert "pass --allow-data-change to start the weighted order" in capsys.readouterr().err
    assert main(["--run-dir", str(plain), "--allow-data-change"]) == 0
    # Two launches in one view: steps 1-2 in the plain order, 3-4 weighted from where the mixture started.
    final = json.loads((plain / "checkpoints" / "step-0000004" / "trainer_state.json").read_text())
    assert consumed_per_source(plain, 3, 4) == final["states"]["loader"]["mixture"]["source_samples"]
    assert run_query(plain, "SELECT list(DISTINCT segment ORDER BY segment) AS s FROM consumed").to_pylist() == [
        {"s": [0, 1]}]


def consumed_per_source(run_dir: Path, first_step: int, last_step: int) -> dict[str, int]:
    """Rows per source that the ``consumed`` view lists for steps ``first_step .. last_step``."""
    rows = run_query(run_dir, f"SELECT source, count(*) AS n FROM consumed WHERE step BETWEEN {first_step} AND "
                              f"{last_step} GROUP BY source").to_pylist()
    return {row["source"]: row["n"] for row in rows}


def test_mixture_state_must_match_the_loader_position(train_rows: SplitRows) -> None:
    order = build_mixture(train_rows, {"email": 1.0, "web": 1.0}, seed=0)
    order.take(0, 16)
    with pytest.raises(CheckpointError, match="mixture order is at sample 16, asked for 8"):
        order.take(8, 8)
