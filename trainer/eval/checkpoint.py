"""Full evaluation of one checkpoint: ``checkpoints/step-N`` -> the whole val split's scores, and an HF export.

``python -m trainer.eval.checkpoint --run-dir RUN --step N [--score] [--pairs] [--export]``, started by ``accelerate
launch`` on the run's ``train.num_processes`` (:func:`trainer.parallel.launch.launch_command`). The checkpoint is
restored exactly as a resume would (the same parallel layout: DDP, FSDP or tensor parallel, whichever trained
it), so every kind of checkpoint the trainer writes can be evaluated. ``--score`` scores every val row, each
process a share, summed across processes as the in-loop evaluation does (so the numbers do not depend on the
number of processes), and writes ``eval/results/step-N/val_split.json``: loss, perplexity and bits per byte,
overall and per source; for a supervised fine-tuning run (``train.mode: sft``) over the trained tokens only (the
chat shards' ``loss_mask``), the result labelled with them (``scored_tokens``: ``assistant`` by default).
``--pairs`` (a DPO run) scores every preference pair instead (:mod:`trainer.eval.preference`): each pair's summed
log-probs in ``eval/results/step-N/preference_logps.parquet`` and the val pairs' DPO loss and rewards in
``eval/results/step-N/preference.json``. ``--export`` writes ``eval/models/step-N/`` (Hugging Face format) for the
downstream tasks. A checkpoint that fails its manifest check is recorded as a failed result naming the folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from accelerate import Accelerator

from core.code_trust import TRUST_REMOTE_CODE_FLAG
from core.errors import CheckpointError, TokenmillError
from core.eval_results import (
    PREFERENCE_TASK,
    VAL_SPLIT_TASK,
    checkpoint_fingerprint,
    describe,
    val_split_fingerprint,
    val_split_rows,
    write_result,
)
from core.files.atomic import sha256_file
from core.layout import CHECKPOINT_MANIFEST
from core.progress_lines import ProgressPrinter
from core.rundir import RunPaths, fingerprint
from tokenization.byte_counts import ScoredBytes
from trainer.config import TrainConfig
from trainer.eval.evaluate import Evaluator
from trainer.eval.preference import score_preference_pairs
from trainer.eval.preference_stage import preference_task_fingerprint
from trainer.eval.run_mode import DPO_DEFAULTS, dpo_settings, is_sft, scored_tokens
from trainer.parallel.accelerator import build_accelerator
from trainer.parallel.launch import LAUNCH_CONFIG_FLAG, exit_with_parent, run_dir_lock
from trainer.precision import MixedPrecision
from trainer.run_config import read_trainer_config
from trainer.train import (
    build_training_loop,
    exit_without_finalising,
    export_if_stale_to,
    fsdp_block_classes,
    leave_process_group,
    open_splits,
)


def val_split_task_fingerprint(paths: RunPaths, precision: str, document_masking: bool | None = None,
                               sft: bool | None = None) -> str:
    """The fingerprint of this run's whole-split scores (:func:`core.eval_results.val_split_fingerprint`); with
    ``train.document_masking`` the rows are scored masked, and with ``train.mode: sft`` only their trained tokens,
    so each is part of it (the fingerprints of runs with neither are unchanged).

    ``document_masking``, ``sft``: the settings as the caller resolved them (the flow, the evaluator); None reads
    run.yaml's.
    """
    _, val_rows = open_splits(paths)
    task_fp = val_split_fingerprint(val_rows.digests, sha256_file(paths.tokenizer), precision)
    if document_masking is None or sft is None:
        train = read_trainer_config(paths.root).train
        document_masking = train.document_masking if document_masking is None else document_masking
        sft = is_sft(train) if sft is None else sft
    if document_masking:
        task_fp = fingerprint("document-masking", task_fp)
    if sft:
        task_fp = fingerprint("trained-tokens", task_fp)
    return task_fp


def evaluate_checkpoint(run_dir: Path, step: int, score: bool, export: bool, trust_remote_code: bool = False,
                        resolved: bool = False, pairs: bool = False) -> None:
    """Restore ``step``'s checkpoint; score the whole val split (``score``), a DPO run's preference pairs
    (``pairs``: :mod:`trainer.eval.preference`) and/or export it (``export``).

    ``trust_remote_code``: the launching command's decision to run the model folder's Python (never run.yaml's).
    ``resolved``: read the configuration the launching flow wrote (``stages/launch.json``), not run.yaml.
    """
    paths = RunPaths(run_dir)
    with run_dir_lock(paths.root):
        config = read_trainer_config(paths.root, trust_remote_code, resolved)
        accelerator = build_accelerator(config.train, paths.root, fsdp_block_classes(paths, config))
        checkpoint = paths.checkpoint(step)
        sft = is_sft(config.train)
        task_fp = val_split_task_fingerprint(paths, config.train.precision, config.train.document_masking,
                                             sft) if score else ""
        settings = dpo_settings(config.train) or dict(DPO_DEFAULTS)
        pairs_fp = preference_task_fingerprint(paths, config.train.precision, settings) if pairs else ""
        try:
            loop = build_training_loop(paths, config, accelerator, allow_data_change=True)
            loop.checkpointer.load_step(step)
        except CheckpointError as err:
            fingerprint = checkpoint_fingerprint(checkpoint) if (checkpoint / CHECKPOINT_MANIFEST).is_file() else ""
            for asked, task, task_fingerprint in ((score, VAL_SPLIT_TASK, task_fp), (pairs, PREFERENCE_TASK, pairs_fp)):
                if asked and accelerator.is_main_process:
                    print(describe(write_result(paths, step, task, fingerprint, task_fingerprint, error=str(err))),
                          flush=True)
            raise
        if score:
            score_val_split(loop.model, paths, config.train, accelerator, step, task_fp,
                            checkpoint_fingerprint(checkpoint), scored_tokens(config.recipe) if sft else None)
        if pairs:
            score_preference_pairs(loop.model, paths, config.train.micro_batch_size, accelerator, step,
                                   (checkpoint_fingerprint(checkpoint), pairs_fp), settings,
                                   MixedPrecision(config.train.precision, accelerator.device.type).autocast)
        if export:
            export_if_stale_to(loop, paths, paths.eval_model(step))


def score_val_split(model: object, paths: RunPaths, train: TrainConfig, accelerator: Accelerator,
                    step: int, task_fp: str, checkpoint_fp: str, scored: str | None = None) -> None:
    """Every val row scored (each process a share, masked as the run trains) and written by the main process,
    which prints progress lines meanwhile (:mod:`core.progress_lines`: the flow's bar follows them).

    ``scored``: None scores every token but padding (pretraining); for supervised fine-tuning the tokens the chat
    shards' ``loss_mask`` trains (``assistant``, ``last_assistant`` or ``all`` as ``chat.loss`` says: the label
    the result records as ``scored_tokens``).
    """
    _, val_rows = open_splits(paths, train.mode)  # SFT rows carry their loss masks: only trained tokens score
    autocast = MixedPrecision(train.precision, accelerator.device.type).autocast
    evaluator = Evaluator(val_rows if val_rows.num_rows else None, train.micro_batch_size, None, accelerator,
                          autocast, byte_counter=ScoredBytes(paths.tokenizer),
                          document_masking=train.document_masking)
    scores = evaluator.evaluate(model, ProgressPrinter("rows") if accelerator.is_main_process else None)
    if not accelerator.is_main_process:
        return
    if scores is None:
        result = write_result(paths, step, VAL_SPLIT_TASK, checkpoint_fp, task_fp,
                              error=f"{paths.shard_index}: no split=val shards to score; set data.val_fraction "
                                    "above 0 and re-run `tokenmill prepare` in a fresh run dir.")
    else:
        result = write_result(paths, step, VAL_SPLIT_TASK, checkpoint_fp, task_fp, rows=val_split_rows(scores),
                              scored_tokens=scored)
    print(describe(result), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.eval.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="run directory holding checkpoints/")
    parser.add_argument("--step", type=int, required=True, help="the checkpoint's step")
    parser.add_argument("--score", action="store_true", help="score the whole validation split")
    parser.add_argument("--export", action="store_true", help="export the checkpoint as a Hugging Face folder")
    parser.add_argument("--pairs", action="store_true",
                        help="score every preference pair of a DPO run (eval/results/step-N/preference_logps.parquet)")
    parser.add_argument(TRUST_REMOTE_CODE_FLAG, action="store_true",
                        help="run the model folder's own Python (auto_map); run.yaml's setting is ignored")
    parser.add_argument(LAUNCH_CONFIG_FLAG, action="store_true",
                        help="read the configuration the launching flow resolved (RUN/stages/launch.json) instead "
                             "of run.yaml")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry; a TokenmillError is printed as one line and exits with status 2."""
    args = parse_args(argv)
    exit_with_parent()
    try:
        evaluate_checkpoint(args.run_dir, args.step, args.score, args.export, args.trust_remote_code,
                            args.resolved_config, args.pairs)
    except TokenmillError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    finally:
        leave_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_without_finalising(status)
    sys.exit(status)
