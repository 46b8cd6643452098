"""``python -m tests.trainer.eval.two_process_scores --run-dir RUN --step N --seed S``: score a DPO run's pairs under
the tiny model of ``seed`` on every launched process (each a share of the rows), as ``trainer.eval.checkpoint
--pairs`` does after restoring a checkpoint; launched by the test with 2 processes."""

from __future__ import annotations

import argparse
from pathlib import Path

from core.rundir import RunPaths
from tests.trainer.eval.conftest import SETTINGS, model_of
from trainer.config import TrainConfig
from trainer.eval.preference import score_preference_pairs
from trainer.parallel.accelerator import build_accelerator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()
    accelerator = build_accelerator(TrainConfig(micro_batch_size=2, num_processes=2))
    score_preference_pairs(model_of(args.seed), RunPaths(args.run_dir), 2, accelerator, args.step,
                           ("checkpoint-fp", "task-fp"), SETTINGS)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
