"""Train entry point: run dir (run.yaml + shards) -> checkpoints/, metrics/, model/; ``accelerate launch`` starts it.

``python -m trainer.train --run-dir RUN [--until-step N]`` trains to N (default train.max_steps) optimizer
steps, resuming from the newest valid checkpoint, then exports ``RUN/model``. Use
:func:`trainer.parallel.launch.launch_command` to build the ``accelerate launch`` argv for several processes.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from core.bucket.run_dir import publish_working_copy, trainer_working_copy
from core.code_trust import TRUST_REMOTE_CODE_FLAG
from core.errors import ConfigError, ShardFormatError, TokenmillError
from core.files.atomic import sha256_file
from core.rundir import RunPaths
from tokenization.chat.stage import read_chat_template
from tokenization.special_tokens import read_special_tokens
from trainer.callbacks import Callback, ProfilerCallback
from trainer.checkpoint.checkpointer import Checkpointer, list_checkpoints
from trainer.checkpoint.tensor_parallel import TensorParallelShards
from trainer.config import TrainConfig, TrainMode
from trainer.eval.evaluate import Evaluator
from trainer.loader.batches import BatchLayout, SplitRows, TrainLoader
from trainer.loader.chat_rows import check_one_conversation_per_row
from trainer.loader.mixture import MixtureOrder, MixtureStage, resolve_weights
from trainer.loader.mixture_config import MixtureScheduleConfig
from trainer.loader.pair_rows import PairRows
from trainer.loop import LoopCounters, ModelSignature, TrainingLoop, seed_everything
from trainer.metrics.segments import RowLossLog, append_segment, segment_record
from trainer.metrics.sink import MetricsSink
from trainer.metrics.telemetry import DevicePeak, Telemetry, device_peak
from trainer.metrics.trackers import Trackers, start_trackers
from trainer.model.export import CHAT_TEMPLATE_FILE, ExportFiles, export_model, exported_step, write_export
from trainer.model.lora import apply_lora, is_lora_model, lora_signature, merged_state_dict, save_adapter
from trainer.model.spec import ModelSpec, model_spec
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.parallel.accelerator import (
    apply_model_options,
    build_accelerator,
    data_parallel_coordinates,
    full_state_dict,
    is_sharded,
    parallelize_model,
    tensor_parallel_mesh,
    tensor_parallel_rank,
)
from trainer.parallel.launch import LAUNCH_CONFIG_FLAG, exit_with_parent, run_dir_lock
from trainer.precision import MixedPrecision
from trainer.preference.evaluate import PairEvaluator
from trainer.preference.objective import PreferenceObjective, build_objective
from trainer.run_config import TrainerSections, read_trainer_config


def open_splits(paths: RunPaths, mode: TrainMode | None = None) -> tuple[SplitRows, SplitRows]:
    """The train and val rows, padded with the run tokenizer's ``<|pad|>`` id; with ``mode`` (``train.mode``) every
    shard must be one that mode trains on, and SFT rows carry their loss masks.

    Raises ShardFormatError when there is no train data, the splits disagree, or the run's tokenizer is not
    the one the shards were packed with; ConfigError naming a shard that ``mode`` cannot train on.
    """
    special = read_special_tokens(paths)
    train_rows = SplitRows(paths.root, "train", special.pad_id, pad_is_eos=special.pad_is_eos, mode=mode)
    val_rows = SplitRows(paths.root, "val", special.pad_id, pad_is_eos=special.pad_is_eos, mode=mode)
    if train_rows.seq_len is None:
        raise ShardFormatError(f"{paths.shard_index}: no split=train shards; run `tokenmill prepare` first.")
    tokenizer_sha256 = sha256_file(paths.tokenizer)
    if train_rows.tokenizer_sha256 | val_rows.tokenizer_sha256 != {tokenizer_sha256}:
        raise ShardFormatError(f"{paths.tokenizer} is not the tokenizer the shards were packed with (sha256 "
                               f"{tokenizer_sha256[:12]}…, the index names another); restore that file, or re-run "
                               "`tokenmill prepare` in a fresh run dir.")
    train_kind, val_kind = (train_rows.seq_len, train_rows.vocab_size), (val_rows.seq_len, val_rows.vocab_size)
    if val_rows.num_rows and val_kind != train_kind:
        raise ShardFormatError(f"{paths.shard_index}: val shards have (seq_len, vocab_size) {val_kind}, train "
                               f"shards {train_kind}; re-run `tokenmill prepare` in a fresh run dir.")
    return train_rows, val_rows


def build_mixture(train_rows: SplitRows, weights: dict[str, float] | None, seed: int,
                  schedule: MixtureScheduleConfig | None = None) -> MixtureOrder | None:
    """The weighted source interleave for run.yaml's ``mixture`` (or ``mixture_schedule``), or None without one."""
    if schedule is None and weights is None:
        return None
    source_rows = train_rows.rows_by_source()
    if schedule is not None:
        return MixtureOrder(source_rows, {}, seed, schedule_stages(schedule, source_rows), schedule.max_repetition)
    resolved = resolve_weights(weights, {name: len(rows) for name, rows in source_rows.items()})
    return MixtureOrder(source_rows, resolved, seed)


def schedule_stages(schedule: MixtureScheduleConfig, source_rows: dict[str, Any]) -> list[MixtureStage]:
    """Each stage's weights normalised over the train sources; ConfigError names the stage key to fix."""
    sizes = {name: len(rows) for name, rows in source_rows.items()}
    stages = []
    for index, stage in enumerate(schedule.stages):
        key = f"mixture_schedule.stages[{index}].weights"
        unknown = sorted(set(stage.weights) - {name for name, size in sizes.items() if size})
        if unknown:
            raise ConfigError(f"run.yaml: {key}: no train rows for source(s) {unknown} (the train shards hold "
                              f"{sorted(sizes)}); fix the name or remove it")
        stages.append(MixtureStage(stage.until_step, resolve_weights(stage.weights, sizes, key)))
    return stages


def build_telemetry(accelerator: Accelerator, train: TrainConfig, paths: RunPaths, flops: float) -> Telemetry:
    """Rank 0 measures (its peak is probed once per device and cached in metrics/); other ranks never log."""
    if accelerator.is_main_process:
        peak = device_peak(accelerator.device, train.precision, train.peak_tflops, paths)
    else:
        peak = DevicePeak(float("nan"), "not measured on this rank")
    return Telemetry(accelerator.device, accelerator.num_processes, flops, peak)


def build_callbacks(accelerator: Accelerator, train: TrainConfig, paths: RunPaths) -> list[Callback]:
    if not train.profile_steps:
        return []
    return [ProfilerCallback(train.profile_steps, paths, accelerator.process_index, accelerator.device)]


_KEPT_UNTIL_EXIT: list[Any] = []
"""The prepared model of a multi-process run, never freed. Its DDP reducer holds the gloo process group (Accelerate
keeps only the unwrapped model). When the last reference dropped as ``train`` returned, ``~ProcessGroupGloo`` joined
gloo's worker thread while holding the GIL, and that thread, freeing the final barrier's tensors, waited for the
GIL: the rank hung after the export, and its launcher with it (py-spy showed both stacks; 4 runs in ~74 of the
multi-machine test). A launched rank leaves through ``exit_without_finalising``, so nothing kept here is destroyed."""


def run_model_spec(paths: RunPaths, config: TrainerSections, train_rows: SplitRows) -> ModelSpec:
    """The spec of the recipe's model for these shards (their vocabulary and row length).

    Pretrained weights are loaded only while no checkpoint exists: a continued-pretraining run that was stopped
    resumes from its own checkpoint, never from the initial weights again (any checkpoint present either
    resumes or fails verification loudly, see :meth:`Checkpointer.load_latest`).
    """
    special = read_special_tokens(paths)
    initial_weights = not list_checkpoints(paths.checkpoints)
    return model_spec(config.model, paths, train_rows.vocab_size, train_rows.seq_len, special.eos_id,
                      special.pad_id, initial_weights=initial_weights)


def build_training_loop(paths: RunPaths, config: TrainerSections, accelerator: Accelerator,
                        allow_data_change: bool = False) -> TrainingLoop:
    """Build every collaborator from the configs and the shards, and compose them into a TrainingLoop."""
    train = config.train
    seed_everything(train.seed)
    train_rows, val_rows = open_splits(paths, train.mode)
    if train.mode == "sft" and not train.document_masking:
        check_one_conversation_per_row([shard.path for shard in train_rows.shards + val_rows.shards],
                                       train_rows.seq_len)
    spec = run_model_spec(paths, config, train_rows)
    model = spec.build(train.seed)
    if train.document_masking:
        spec.check_document_masking(model)
    if train.lora is not None:
        model = apply_lora(model, train.lora, train.seed)
    model = apply_model_options(parallelize_model(model, accelerator, spec), train, spec)
    num_params = sum(p.numel() for p in model.parameters())  # a DTensor counts its full size; tied ones once
    optimizer = build_optimizer(model, train)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, train))
    if accelerator.num_processes > 1:
        _KEPT_UNTIL_EXIT.append(model)
    # The processes of one tensor-parallel group are one data-parallel replica: they read the same batch.
    layout = BatchLayout(train.micro_batch_size, train.grad_accum_steps, *data_parallel_coordinates(accelerator))
    pairs = PairRows(train_rows) if train.mode == "dpo" else None
    loader = TrainLoader(train_rows, layout, train.seed, allow_data_change,
                         build_mixture(train_rows, config.mixture, train.seed, config.mixture_schedule),
                         train.document_masking, pairs)
    precision = MixedPrecision(train.precision, accelerator.device.type, train.loss_scale_growth_interval,
                               sharded=is_sharded(accelerator))
    preference = build_objective(paths, config, (train_rows, val_rows), accelerator, precision.autocast)
    counters = LoopCounters()
    states = {"signature": model_signature(spec, train), "loop": counters, "loader": loader}
    if precision.scaler is not None:
        states["precision"] = precision
    return TrainingLoop(
        accelerator=accelerator, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
        evaluator=build_evaluator(train, val_rows, accelerator, precision, preference),
        checkpointer=Checkpointer(accelerator, paths, train.keep_last, states,
                                  build_shards(accelerator, model, optimizer), async_save=train.async_checkpoint),
        metrics=MetricsSink(paths, enabled=accelerator.is_main_process),  # trackers join once resumed
        train=train, counters=counters, precision=precision,
        telemetry=build_telemetry(accelerator, train, paths, spec.flops_per_token(num_params)),
        callbacks=build_callbacks(accelerator, train, paths), spec=spec,
        chat_template_file=config.chat_template_file, preference=preference)


def build_evaluator(train: TrainConfig, val_rows: SplitRows, accelerator: Accelerator, precision: MixedPrecision,
                    preference: PreferenceObjective | None) -> Evaluator | PairEvaluator:
    """The in-loop evaluator: val loss and perplexity, or a dpo run's val pairs' loss and rewards."""
    rows = val_rows if val_rows.num_rows else None
    if preference is not None:
        return PairEvaluator(None if rows is None else PairRows(rows), train.micro_batch_size, train.eval_batches,
                             accelerator, preference, precision.autocast)
    return Evaluator(rows, train.micro_batch_size, train.eval_batches, accelerator, precision.autocast,
                     document_masking=train.document_masking)



def model_signature(spec: ModelSpec, train: TrainConfig) -> ModelSignature:
    """What a checkpoint records of the model: the spec's signature, with the adapters' settings under LoRA."""
    signature = spec.signature()
    return ModelSignature(signature if train.lora is None else {**signature, "lora": lora_signature(train.lora)})


def build_shards(accelerator: Accelerator, model: Any, optimizer: Any) -> TensorParallelShards | None:
    """The split model and optimizer a tensor-parallel checkpoint writes itself; None otherwise."""
    return None if tensor_parallel_mesh(accelerator) is None else TensorParallelShards(accelerator, model, optimizer)


def train(run_dir: Path | str, until_step: int | None = None, allow_data_change: bool = False,
          trust_remote_code: bool = False, resolved: bool = False) -> int:
    """Train (resuming when a checkpoint exists) to ``until_step`` (default max_steps), export model/; returns the step.

    ``run_dir`` may be a bucket's URL (``s3://bucket/runs/NAME``): training then runs on its working copy, pulled
    on each machine, and rank 0 publishes checkpoints and the export (:func:`core.bucket.run_dir.trainer_working_copy`).

    ``until_step`` may pass ``max_steps``: an incremental refresh keeps training on new data, and the
    learning rate stays at its cosine floor past ``max_steps``.

    Raises TrainingDivergedError (a TokenmillError) after ``train.max_nonfinite_steps`` bad steps in a row, and
    RunLockedError when another process holds the run dir (see :func:`trainer.parallel.launch.run_dir_lock`).
    ``trust_remote_code``: run the model folder's own Python (``auto_map``); never taken from run.yaml.
    ``resolved``: read the configuration the launching flow resolved and wrote (``stages/launch.json``), not
    run.yaml (:mod:`trainer.run_config`).
    """
    with trainer_working_copy(run_dir) as local:
        return _train(RunPaths(local), until_step, allow_data_change, trust_remote_code, resolved)


def _train(paths: RunPaths, until_step: int | None, allow_data_change: bool, trust_remote_code: bool,
           resolved: bool) -> int:
    with run_dir_lock(paths.root):  # raises RunLockedError while another process (`tokenmill prepare`) holds it
        config = read_trainer_config(paths.root, trust_remote_code, resolved)
        accelerator = build_accelerator(config.train, paths.root, fsdp_block_classes(paths, config))
        loop: TrainingLoop | None = None
        trackers = Trackers({})
        try:
            loop = build_training_loop(paths, config, accelerator, allow_data_change)
            resumed_step = loop.checkpointer.load_latest()
            if resumed_step is not None:
                accelerator.print(f"Resuming from checkpoint at step {resumed_step}", flush=True)
            loop.metrics.drop_rows_after(resumed_step)
            if accelerator.is_main_process and config.train.trackers:
                trackers = start_trackers(config.train.trackers, paths, config.train.tracker_project,
                                          config.recipe,
                                          resuming=resumed_step is not None)
                loop.metrics.tracker = trackers.log
            target_step = until_step if until_step is not None else config.train.max_steps
            if loop.counters.step < target_step:
                record_launch(loop, paths, config)
            run_to(loop, target_step)
            export_if_stale(loop, paths)
            if accelerator.is_main_process:
                publish_working_copy(paths.root)  # a bucket run dir's working copy: the export, the metrics
        finally:
            if loop is not None:
                finish_background_save(loop)
            trackers.finish()  # flushes every tracker even when training stops with an error
            accelerator.end_training()
    return loop.counters.step


def finish_background_save(loop: TrainingLoop) -> None:
    """On the way out (after an error too): let an async checkpoint in flight finish while the run dir is still
    locked, so an error at step N+1 does not cost checkpoint N; its own failure is printed, as the first error
    is the one raised."""
    problem = loop.checkpointer.close()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)


MIXTURE_SECTIONS = ("mixture", "mixture_schedule")
"""The recipe sections that decide the data order besides the seed: each launch records them
(trainer.metrics.consumed)."""


def record_launch(loop: TrainingLoop, paths: RunPaths, config: TrainerSections) -> None:
    """Rank 0 appends this launch's loader setup to metrics/train_segments.jsonl (the ``consumed`` view's source);
    with ``train.log_row_losses`` each data-parallel rank's first TP process then logs its rows' losses.

    Collective: every rank learns the launch's segment number (its row-loss file is named by it).
    """
    accelerator = loop.accelerator
    segment = [None]
    if accelerator.is_main_process:
        sections = config.model_dump(mode="json", include=set(MIXTURE_SECTIONS))
        mixture = {key: sections[key] for key in MIXTURE_SECTIONS}
        record = segment_record(loop.loader, loop.counters.step, accelerator.num_processes, mixture)
        segment = [append_segment(paths, record)]
    broadcast_object_list(segment)
    if config.train.log_row_losses and tensor_parallel_rank(accelerator) == 0:
        layout = loop.loader.layout
        loop.row_losses = RowLossLog(paths, segment[0], layout.rank, layout.micro_batch_size)


def fsdp_block_classes(paths: RunPaths, config: TrainerSections) -> tuple[str, ...]:
    """The model's decoder block classes when the run shards with FSDP (its shard unit), else none."""
    if not config.train.fsdp:
        return ()
    train_rows, _ = open_splits(paths, config.train.mode)
    return tuple(run_model_spec(paths, config, train_rows).block_class_names())


def run_to(loop: TrainingLoop, target_step: int) -> None:
    """Train to ``target_step``, or say that the checkpoint is already there."""
    accelerator = loop.accelerator
    if loop.counters.step < target_step:
        accelerator.print(f"training to step {target_step} on {accelerator.num_processes} process(es), "
                          f"{loop.tokens_per_step:,} tokens/step", flush=True)
        loop.run(target_step)
    else:
        accelerator.print(f"already at step {loop.counters.step} (target {target_step}); nothing to train",
                          flush=True)


def export_if_stale(loop: TrainingLoop, paths: RunPaths) -> None:
    """Write model/ from the current weights unless it already holds this step (rank 0 writes); a LoRA run with
    ``train.lora.export: adapter`` writes its adapter there instead of the merged model.

    Collective: under FSDP every rank sends its shards to rank 0, under TP every rank gathers every slice.
    """
    lora = loop.train.lora
    export_if_stale_to(loop, paths, paths.model, adapter=lora is not None and lora.export == "adapter")


def export_if_stale_to(loop: TrainingLoop, paths: RunPaths, target: Path, adapter: bool = False) -> None:
    """Write ``target`` (a folder in the run dir) from the current weights unless it already holds this step.

    ``adapter``: a LoRA model's adapter alone (else a LoRA model is exported merged). Collective, as
    :func:`export_if_stale`.
    """
    accelerator = loop.accelerator
    stale = [accelerator.is_main_process and exported_step(target) != loop.counters.step]
    broadcast_object_list(stale)
    if stale[0]:
        module = accelerator.unwrap_model(loop.model)
        lora = is_lora_model(module)  # whole on every rank (LoRA refuses FSDP and TP): nothing to gather
        state_dict = None if lora else full_state_dict(accelerator, loop.model)
        if accelerator.is_main_process:
            files = ExportFiles(paths.tokenizer, tuple(base_model_tokenizer_files(paths)),
                                {"step": loop.counters.step, "tokens_seen": loop.counters.tokens_seen},
                                run_chat_template(paths, loop.chat_template_file))
            if adapter:
                write_export(paths, target, functools.partial(save_adapter, module), files, 0)
            else:
                base = module.get_base_model() if lora else module
                weights = loop.spec.export_weights(base, merged_state_dict(module) if lora else state_dict)
                export_model(weights, loop.spec.export_config(), paths, files.tokenizer_json,
                             files.training_state, files.tokenizer_extras, target, files.chat_template)
            accelerator.print(f"exported step {loop.counters.step} to {target}", flush=True)
    accelerator.wait_for_everyone()


BASE_MODEL_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", CHAT_TEMPLATE_FILE)
"""A model's own tokenizer settings (and chat template), exported beside tokenizer.json when the run packs with that
tokenizer."""


def base_model_tokenizer_files(paths: RunPaths) -> list[Path]:
    """``base_model/``'s tokenizer settings when the run's tokenizer is that folder's (same bytes), else none."""
    own = paths.base_model_tokenizer
    if not (own.is_file() and paths.tokenizer.is_file() and sha256_file(own) == sha256_file(paths.tokenizer)):
        return []
    return [paths.base_model / name for name in BASE_MODEL_TOKENIZER_FILES if (paths.base_model / name).is_file()]


def run_chat_template(paths: RunPaths, chat_template_file: str | None) -> str | None:
    """The chat template the run's conversations were rendered with, to write into the export; None: the base
    model's own (in the tokenizer files exported beside it), or no chat template at all.

    ``chat_template_file`` (the trainer sections' field; absolute, or relative to the run dir) wins; else the
    template the chat data stage rendered the shards with (recorded in their states); else the run's
    ``tokenizer/chat_template.jinja`` when present. ConfigError naming the file when it cannot be read.
    """
    rendered_with = read_chat_template(paths) if chat_template_file is None else None
    if rendered_with is not None:
        return rendered_with
    path = paths.tokenizer_chat_template if chat_template_file is None else paths.root / chat_template_file
    if chat_template_file is None and not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the chat template to export ({type(err).__name__}); restore the file "
                          "the chat data stage rendered with, or re-run `tokenmill prepare`.") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True,
                        help="run directory holding run.yaml and shards/, or its URL in a bucket (s3://…)")
    parser.add_argument("--until-step", type=int, default=None, help="stop at this step (default: max_steps)")
    parser.add_argument("--allow-data-change", action="store_true",
                        help="resume although the train shards changed since the checkpoint (incremental refresh)")
    parser.add_argument(TRUST_REMOTE_CODE_FLAG, action="store_true",
                        help="run the model folder's own Python (auto_map); run.yaml's model.trust_remote_code "
                             "is ignored, a run dir never decides that its code runs")
    parser.add_argument(LAUNCH_CONFIG_FLAG, action="store_true",
                        help="read the configuration the launching flow resolved (RUN/stages/launch.json) instead "
                             "of run.yaml")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry; a TokenmillError is printed as one line (no traceback) and exits with status 2."""
    args = parse_args(argv)
    exit_with_parent()
    try:
        train(args.run_dir, args.until_step, args.allow_data_change, args.trust_remote_code, args.resolved_config)
    except TokenmillError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        leave_process_group()
    return 0


def leave_process_group() -> None:
    """Tear the process group down before exit: gloo threads alive at interpreter exit can abort a rank
    ("terminate called without an active exception") after training has already finished."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_without_finalising(code: int) -> NoReturn:
    """Leave a launched multi-process run without interpreter finalisation, once everything is written.

    After the process group is destroyed, a gloo rank still aborted at interpreter exit ("terminate called
    without an active exception": a C++ thread object destroyed while joinable) in about one FSDP test run
    in ten, after the checkpoint, the export and the metrics were complete; the abort turned a finished run
    into a failed one. Skipping the C++ static destructors avoids it; the logs are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_without_finalising(status)
    sys.exit(status)
