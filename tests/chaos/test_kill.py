"""``kill -9`` anywhere: a ``tokenmill prepare`` or ``tokenmill train`` whose whole process group is SIGKILLed at a
seeded random moment, then re-run to completion, ends exactly where an uninterrupted run in another dir ends."""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from core.shards.store import verify_shards
from tests.chaos.conftest import (
    DATA_ARTIFACTS,
    LiveCommand,
    build_chaos_corpus,
    file_bytes,
    funnel_total,
    planted_records,
    start_tokenmill,
    table_rows,
    temp_leftovers,
    tokenmill,
    wait_gone,
    write_chaos_recipe,
)
from trainer.checkpoint.checkpointer import list_checkpoints, verify_checkpoint
from trainer.metrics.sink import read_metric_rows

pytestmark = pytest.mark.slow

PROGRESS = re.compile(r"Task run '[^']+' - [a-z-]+: ")
"""A stage call finished (flows.progress.bars): the moments a prepare run can be killed after."""
STEP_LINE = re.compile(r" - step (\d+)/\d+ \|")
METRIC_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_seen", "epoch", "skipped_steps")
"""Deterministic columns of a train metrics row (timings and throughput are not)."""


@dataclass(frozen=True)
class Straight:
    """An uninterrupted prepare (and, separately, train) of the chaos recipe."""

    root: Path
    recipe: Path
    prepared: Path
    pristine: Path
    """A copy of ``prepared`` taken before anything trained in it."""
    num_progress_lines: int


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, cli_env: dict[str, str]) -> Straight:
    root = tmp_path_factory.mktemp("kill")
    recipe = write_chaos_recipe(root, build_chaos_corpus(root))
    prepared = root / "straight"
    command = start_tokenmill("prepare", recipe, "--run-dir", prepared, env=cli_env)
    assert command.finish() == 0, "\n".join(command.lines[-30:])
    pristine = root / "pristine"
    shutil.copytree(prepared, pristine)
    return Straight(root, recipe, prepared, pristine, sum(bool(PROGRESS.search(line)) for line in command.lines))


def kill_when(command: LiveCommand, predicate: Callable[[list[str]], bool], delay_s: float, *,
              whole_tree: bool) -> dict[psutil.Process, str]:
    """Wait for ``predicate`` on the output, sleep ``delay_s``, SIGKILL the process group; return the
    descendants alive then (the trainer runs in a session of its own), with their command lines."""
    assert command.wait_for(predicate), "the command finished before the chosen kill moment"
    time.sleep(delay_s)
    descendants = {}
    for process in command.descendants():
        with contextlib.suppress(psutil.Error):
            descendants[process] = " ".join(process.cmdline())
    command.kill_group()
    if whole_tree:  # the whole machine goes down: the trainer's own group too
        for process in descendants:
            process.kill()
    assert command.finish() == -signal.SIGKILL, "killed mid-run, not finished already"
    return descendants


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prepare_killed_at_a_random_moment_then_rerun_matches_an_uninterrupted_run(
        straight: Straight, cli_env: dict[str, str], seed: int) -> None:
    rng = random.Random(seed)
    # Seed s kills in the s-th third of the run: after the k-th finished stage call (k = 0: as soon as the flow
    # begins), plus a random fraction of a stage. The last two calls are left out so the run is still going.
    last = straight.num_progress_lines - 3
    k = rng.randint(seed * last // 3, (seed + 1) * last // 3)
    delay_s = rng.uniform(0.0, 0.1)
    run_dir = straight.root / f"prepare-killed-{seed}"

    def reached(lines: list[str]) -> bool:
        done = sum(bool(PROGRESS.search(line)) for line in lines)
        return done >= k and any("Beginning flow run" in line for line in lines)

    command = start_tokenmill("prepare", straight.recipe, "--run-dir", run_dir, env=cli_env)
    assert wait_gone(list(kill_when(command, reached, delay_s, whole_tree=False))) == []

    rerun = tokenmill("prepare", straight.recipe, "--run-dir", run_dir, env=cli_env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    assert table_rows(run_dir) == table_rows(straight.prepared)
    assert funnel_total(run_dir) == planted_records(straight.root / "corpus")
    expected = file_bytes(straight.prepared, DATA_ARTIFACTS)
    actual = file_bytes(run_dir, DATA_ARTIFACTS)
    assert sorted(actual) == sorted(expected)
    differing = [name for name in expected if actual[name] != expected[name]]
    assert differing == [], f"seed {seed} (k={k}, +{delay_s:.3f} s): not byte-identical"
    verified = tokenmill("shards", "verify", run_dir)
    assert verified.returncode == 0 and verified.stdout.startswith("ok: "), verified.stdout
    assert verify_shards(run_dir) == []
    assert temp_leftovers(run_dir) == [], f"seed {seed} (k={k}, +{delay_s:.3f} s)"


@pytest.fixture(scope="module")
def straight_training(straight: Straight, cli_env: dict[str, str]) -> Path:
    run_dir = straight.root / "train-straight"
    shutil.copytree(straight.pristine, run_dir)
    result = tokenmill("train", straight.recipe, "--run-dir", run_dir, env=cli_env)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def metric_rows(run_dir: Path, name: str) -> list[tuple]:
    rows = read_metric_rows(run_dir / "metrics" / name)
    keys = METRIC_KEYS if name == "train.jsonl" else ("step", "val_loss", "val_ppl", "tokens_seen")
    return [tuple(row.get(key) for key in keys) for row in rows]


@pytest.mark.parametrize(("seed", "whole_tree"), [(3, True), (4, False)], ids=["everything", "flow-only"])
def test_train_killed_at_a_random_moment_then_rerun_is_bitwise_identical(
        straight: Straight, straight_training: Path, cli_env: dict[str, str], seed: int, whole_tree: bool) -> None:
    rng = random.Random(seed)
    kill_step = rng.randint(3, 30)
    delay_s = rng.uniform(0.0, 0.03)
    run_dir = straight.root / f"train-killed-{seed}"
    shutil.copytree(straight.pristine, run_dir)

    def reached(lines: list[str]) -> bool:
        return any((match := STEP_LINE.search(line)) and int(match.group(1)) >= kill_step for line in lines)

    command = start_tokenmill("train", straight.recipe, "--run-dir", run_dir, env=cli_env)
    children = kill_when(command, reached, delay_s, whole_tree=whole_tree)
    assert any("trainer.train" in cmdline for cmdline in children.values()), "killed while training"
    # flow-only: the orphaned trainer notices its parent is gone (TOKENMILL_PARENT_PID) and exits by itself.
    assert wait_gone(list(children), timeout_s=60) == [], "the trainer outlived the flow that launched it"

    rerun = tokenmill("train", straight.recipe, "--run-dir", run_dir, env=cli_env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    context = f"seed {seed}: killed after step {kill_step} + {delay_s:.3f} s"
    assert (run_dir / "model" / "model.safetensors").read_bytes() == \
        (straight_training / "model" / "model.safetensors").read_bytes(), context
    assert metric_rows(run_dir, "train.jsonl") == metric_rows(straight_training, "train.jsonl"), context
    assert metric_rows(run_dir, "eval.jsonl") == metric_rows(straight_training, "eval.jsonl"), context
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    expected_steps = [step for step, _ in list_checkpoints(straight_training / "checkpoints")]
    assert [step for step, _ in checkpoints] == expected_steps
    assert all(verify_checkpoint(folder) is None for _, folder in checkpoints)
    assert verify_shards(run_dir) == []
    assert temp_leftovers(run_dir) == [], context


def test_two_prepares_at_once_on_one_run_dir_never_corrupt_it(straight: Straight, cli_env: dict[str, str]) -> None:
    run_dir = straight.root / "twice-at-once"
    commands = [start_tokenmill("prepare", straight.recipe, "--run-dir", run_dir, env=cli_env) for _ in range(2)]
    codes = [command.finish() for command in commands]
    # Started together, the second is normally refused while the first holds the run dir's lock; should it
    # only start after the first finished, it finds every stage done. Either way, never a mixed result.
    assert sorted(codes) in ([0, 0], [0, 2]), codes
    for command, code in zip(commands, codes, strict=True):
        output = "\n".join(command.lines)
        assert "Traceback" not in output, output[-3000:]
        if code == 2:
            errors = [line for line in command.lines if line.startswith("error: ")]
            assert len(errors) == 1 and "run directory is in use by pid" in errors[0], output[-3000:]
    assert table_rows(run_dir) == table_rows(straight.prepared)
    expected, actual = file_bytes(straight.prepared, DATA_ARTIFACTS), file_bytes(run_dir, DATA_ARTIFACTS)
    assert sorted(actual) == sorted(expected)
    assert [name for name in expected if actual[name] != expected[name]] == []
    assert temp_leftovers(run_dir) == []
