"""Train entry point: run dir (run.yaml + shards) -> checkpoints/, metrics/, model/; ``accelerate launch`` starts it.

``python -m trainer.train --run-dir RUN [--until-step N]`` trains to min(train.max_steps, N) optimizer
steps, resuming from the newest valid checkpoint, then exports ``RUN/model``. Use
:func:`trainer.launch.launch_command` to build the ``accelerate launch`` argv for several processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accelerate import Accelerator
from pydantic import ValidationError

from pipeline.config import FrozenConfig, describe_validation_error, load_yaml_mapping
from pipeline.errors import ConfigError, ShardFormatError, TokenmillError
from pipeline.rundir import RunPaths
from trainer.checkpoint import Checkpointer
from trainer.config import ModelConfig, TrainConfig
from trainer.data import BatchLayout, SplitRows, TrainLoader
from trainer.evaluate import Evaluator
from trainer.export import export_model, exported_step
from trainer.launch import exit_with_parent
from trainer.loop import (
    LoopCounters,
    ModelSignature,
    TrainingLoop,
    build_accelerator,
    build_lr_scheduler,
    build_optimizer,
    seed_everything,
)
from trainer.metrics import MetricsSink
from trainer.model import ModelShape, build_model, flops_per_token


class TrainerSections(FrozenConfig):
    """The two recipe sections the trainer reads (the rest of run.yaml belongs to other stages)."""

    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()


def read_trainer_config(run_dir: Path) -> TrainerSections:
    """Validate ``model`` and ``train`` of ``RUN/run.yaml``; raises ConfigError naming the key to fix."""
    path = RunPaths(Path(run_dir)).recipe
    recipe = load_yaml_mapping(path, "run recipe")
    sections = {key: recipe[key] for key in ("model", "train") if recipe.get(key) is not None}
    try:
        config = TrainerSections.model_validate(sections)
        config.model.resolved_dims()
    except (ValidationError, ValueError) as err:
        message = describe_validation_error(err, path) if isinstance(err, ValidationError) else f"{path}: {err}"
        raise ConfigError(message) from None
    return config


def open_splits(paths: RunPaths) -> tuple[SplitRows, SplitRows]:
    """The train and val rows; raises ShardFormatError when there is no train data or the splits disagree."""
    train_rows, val_rows = SplitRows(paths.root, "train"), SplitRows(paths.root, "val")
    if train_rows.seq_len is None:
        raise ShardFormatError(f"{paths.shard_index}: no split=train shards; run `tokenmill prepare` first.")
    train_kind, val_kind = (train_rows.seq_len, train_rows.vocab_size), (val_rows.seq_len, val_rows.vocab_size)
    if val_rows.num_rows and val_kind != train_kind:
        raise ShardFormatError(f"{paths.shard_index}: val shards have (seq_len, vocab_size) {val_kind}, train "
                               f"shards {train_kind}; re-run `tokenmill prepare` in a fresh run dir.")
    return train_rows, val_rows


def build_training_loop(run_dir: Path, config: TrainerSections, accelerator: Accelerator,
                        allow_data_change: bool = False) -> TrainingLoop:
    """Build every collaborator from the configs and the shards, and compose them into a TrainingLoop."""
    paths, train = RunPaths(Path(run_dir)), config.train
    seed_everything(train.seed)
    train_rows, val_rows = open_splits(paths)
    shape = ModelShape(config.model.resolved_dims(), train_rows.vocab_size, train_rows.seq_len)
    model = build_model(shape, train.seed)
    num_params = model.num_parameters()
    optimizer = build_optimizer(model, train)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, train))
    layout = BatchLayout(train.micro_batch_size, train.grad_accum_steps, accelerator.num_processes,
                         accelerator.process_index)
    loader = TrainLoader(train_rows, layout, train.seed, allow_data_change)
    counters = LoopCounters()
    states = {"signature": ModelSignature(shape), "loop": counters, "loader": loader}
    return TrainingLoop(
        accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
        evaluator=Evaluator(val_rows if val_rows.num_rows else None, train.micro_batch_size, train.eval_batches,
                            accelerator),
        checkpointer=Checkpointer(accelerator, paths.checkpoints, train.keep_last, states),
        metrics=MetricsSink(paths.metrics, enabled=accelerator.is_main_process),
        train=train, counters=counters, flops_per_token=flops_per_token(shape, num_params))


def train(run_dir: Path, until_step: int | None = None, allow_data_change: bool = False) -> int:
    """Train (resuming when a checkpoint exists) to min(max_steps, until_step), export model/; returns the step."""
    run_dir = Path(run_dir)
    config = read_trainer_config(run_dir)
    accelerator = build_accelerator(config.train)
    loop = build_training_loop(run_dir, config, accelerator, allow_data_change)
    resumed_step = loop.checkpointer.load_latest()
    if resumed_step is not None:
        accelerator.print(f"Resuming from checkpoint at step {resumed_step}", flush=True)
    loop.metrics.drop_rows_after(resumed_step)
    target_step = min(config.train.max_steps, until_step if until_step is not None else config.train.max_steps)
    if loop.counters.step < target_step:
        accelerator.print(f"training to step {target_step} on {accelerator.num_processes} process(es), "
                          f"{loop.tokens_per_step:,} tokens/step", flush=True)
        loop.run(target_step)
    else:
        accelerator.print(f"already at step {loop.counters.step} (target {target_step}); nothing to train",
                          flush=True)
    export_if_stale(loop, RunPaths(run_dir))
    accelerator.end_training()
    return loop.counters.step


def export_if_stale(loop: TrainingLoop, paths: RunPaths) -> None:
    """Write model/ from the current weights unless it already holds this step (rank 0 writes)."""
    accelerator = loop.accelerator
    if accelerator.is_main_process and exported_step(paths.model) != loop.counters.step:
        module = accelerator.unwrap_model(loop.model)
        export_model(module.state_dict(), module.shape, paths.model, paths.tokenizer,
                     {"step": loop.counters.step, "tokens_seen": loop.counters.tokens_seen})
        accelerator.print(f"exported step {loop.counters.step} to {paths.model}", flush=True)
    accelerator.wait_for_everyone()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding run.yaml and shards/")
    parser.add_argument("--until-step", type=int, default=None, help="stop at this step (capped by max_steps)")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume although the train shards changed since the checkpoint (incremental refresh)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry; a TokenmillError is printed as one line (no traceback) and exits with status 2."""
    args = parse_args(argv)
    exit_with_parent()
    try:
        train(args.run_dir, args.until_step, args.allow_data_change)
    except TokenmillError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
