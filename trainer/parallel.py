"""Parallelism and memory options: TrainConfig -> the Accelerator (DDP, FSDP2, DeepSpeed) and model transforms.

Data parallelism is the default: ``accelerate launch`` starts ``train.num_processes`` processes and
Accelerate wraps the model in DDP. ``train.fsdp`` shards parameters, gradients and AdamW state
(FSDP2, the ZeRO-3 layout) through Accelerate's FSDP plugin, one unit per decoder block.
``train.deepspeed_config`` hands a DeepSpeed JSON to Accelerate's DeepSpeed plugin instead (GPUs only).
Activation checkpointing and ``torch.compile`` act on the model before ``accelerator.prepare``.
See docs/parallelism.md for when each pays.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ProjectConfiguration

from pipeline.errors import ConfigError
from trainer.config import TrainConfig
from trainer.model import LlamaForCausalLM
from trainer.precision import check_precision

TENSORBOARD_DIR = Path("metrics") / "tensorboard"
"""Where TensorBoard event files go, relative to the run dir (``tensorboard --logdir RUN/metrics/tensorboard``)."""

TRACKER_PROJECT = "train"
"""Accelerate's tracker project name: the event files land in ``metrics/tensorboard/train/``."""


def build_accelerator(train: TrainConfig, run_dir: Path | None = None) -> Accelerator:
    """The Accelerator for this run; with ``run_dir``, TensorBoard logging goes to ``RUN/metrics/tensorboard``.

    Mixed precision is left to :class:`trainer.precision.MixedPrecision` (``mixed_precision="no"`` here).
    """
    on_gpu = torch.cuda.is_available()
    check_precision(train.precision, on_gpu=on_gpu)
    fsdp = fsdp_plugin() if train.fsdp and _launched_world_size() > 1 else None
    if train.fsdp and fsdp is None:
        warnings.warn("train.fsdp has no effect on 1 process; set train.num_processes >= 2 to shard", stacklevel=2)
    # cpu=True on a GPU-less machine: without it Accelerate 1.15 ignores torchrun's WORLD_SIZE there and
    # every launched process trains alone (DistributedType.NO); with it they form a gloo group (MULTI_CPU).
    # step_scheduler_with_optimizer=False: Accelerate would otherwise step the schedule once per
    # *process* each optimizer step; ours counts optimizer steps, whatever the number of processes.
    accelerator = Accelerator(
        cpu=not on_gpu, mixed_precision="no", gradient_accumulation_steps=train.grad_accum_steps,
        step_scheduler_with_optimizer=False, fsdp_plugin=fsdp,
        deepspeed_plugin=deepspeed_plugin(train, run_dir, on_gpu), **tracking_options(train, run_dir))
    if fsdp is not None and accelerator.distributed_type == DistributedType.MULTI_CPU:
        route_cpu_processes_to_fsdp(accelerator, fsdp)
    return accelerator


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_plugin() -> FullyShardedDataParallelPlugin:
    """FSDP2 with one shard unit per decoder block, resharded after forward (ZeRO-3), sharded checkpoints."""
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False)


def route_cpu_processes_to_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make ``prepare`` shard with FSDP2 on CPU processes (gloo) instead of silently wrapping in DDP.

    Accelerate 1.15 picks MULTI_CPU for CPU processes before it looks at the FSDP plugin, and then
    ignores the plugin without a word. Torch's FSDP2 itself runs on gloo (verified: prepare, clip,
    sharded save_state/load_state, full get_state_dict), so the process-wide state is switched to FSDP.
    """
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def deepspeed_plugin(train: TrainConfig, run_dir: Path | None, on_gpu: bool) -> object | None:
    """Accelerate's DeepSpeed plugin for ``train.deepspeed_config``; ConfigError when it cannot run here."""
    if train.deepspeed_config is None:
        return None
    path = Path(train.deepspeed_config)
    if not path.is_absolute() and run_dir is not None:
        path = Path(run_dir) / path
    if not path.is_file():
        raise ConfigError(f"train.deepspeed_config: {path} does not exist; give an absolute path or one relative "
                          "to the run dir.")
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"train.deepspeed_config: {path} is not valid JSON ({err}); fix the file.") from None
    if not on_gpu:
        raise ConfigError("train.deepspeed_config: DeepSpeed needs CUDA GPUs (Accelerate ignores it on CPU); "
                          "remove it for CPU runs, or use train.fsdp.")
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("train.deepspeed_config: DeepSpeed is not installed; `pip install deepspeed` on the "
                          "GPU machine, or use train.fsdp instead.")
    if train.precision != "fp32":
        raise ConfigError("train.deepspeed_config: DeepSpeed sets the precision from its JSON (bf16.enabled / "
                          "fp16.enabled); set train.precision: fp32 in the recipe.")
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=str(path))


def tracking_options(train: TrainConfig, run_dir: Path | None) -> dict[str, object]:
    """Accelerator kwargs that send ``accelerator.log`` to TensorBoard under the run dir (if enabled)."""
    if not train.tensorboard or run_dir is None:
        return {}
    if importlib.util.find_spec("tensorboard") is None:  # Accelerate would drop the tracker without a word
        warnings.warn("train.tensorboard: the tensorboard package is not installed, so nothing is logged there "
                      "(metrics/*.jsonl still are); `pip install tensorboard` or set train.tensorboard: false",
                      stacklevel=3)
        return {}
    run_dir = Path(run_dir)
    return {"log_with": "tensorboard",
            "project_config": ProjectConfiguration(project_dir=str(run_dir),
                                                   logging_dir=str(run_dir / TENSORBOARD_DIR))}


def apply_model_options(model: LlamaForCausalLM, train: TrainConfig) -> LlamaForCausalLM:
    """Activation checkpointing and per-block ``torch.compile`` (in place: parameter names do not change)."""
    model.model.activation_checkpointing = train.activation_checkpointing
    if train.compile:
        for layer in model.model.layers:
            layer.compile()
    return model


def is_sharded(accelerator: Accelerator) -> bool:
    """True when parameters are split across processes (FSDP): every rank must then run every forward."""
    return accelerator.distributed_type == DistributedType.FSDP
