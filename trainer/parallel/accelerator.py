"""Parallelism and memory options: TrainConfig -> the Accelerator (DDP, FSDP2, TP, DeepSpeed) and model transforms.

Data parallelism is the default: ``accelerate launch`` starts ``train.num_processes`` processes and
Accelerate wraps the model in DDP. ``train.fsdp`` shards parameters, gradients and AdamW state
(FSDP2, the ZeRO-3 layout) through Accelerate's FSDP plugin, one unit per decoder block.
``train.tensor_parallel_size`` splits every attention and MLP matmul over a group of processes
(DTensor, a 2-D ``dp x tp`` device mesh); the groups are data-parallel replicas of each other.
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
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from core.errors import ConfigError
from trainer.config import TrainConfig
from trainer.precision import check_precision

if TYPE_CHECKING:  # model_spec imports the export, which imports the checkpointer, which imports this module
    from trainer.model.spec import ModelSpec

def build_accelerator(train: TrainConfig, run_dir: Path | None = None,
                      block_class_names: tuple[str, ...] = ("LlamaDecoderLayer",)) -> Accelerator:
    """The Accelerator for this run (the experiment trackers are started by :mod:`trainer.metrics.trackers`, not here).

    ``block_class_names``: the model's decoder block classes, FSDP's shard unit (:meth:`ModelSpec.block_class_names`).

    Mixed precision is left to :class:`trainer.precision.MixedPrecision` (``mixed_precision="no"`` here).
    """
    on_gpu = torch.cuda.is_available()
    check_precision(train.precision, on_gpu=on_gpu)
    fsdp = fsdp_plugin(block_class_names) if train.fsdp and _launched_world_size() > 1 else None
    if train.fsdp and fsdp is None:
        warnings.warn("train.fsdp has no effect on 1 process; set train.num_processes >= 2 to shard", stacklevel=2)
    # cpu=True on a GPU-less machine: without it Accelerate 1.15 ignores torchrun's WORLD_SIZE there and
    # every launched process trains alone (DistributedType.NO); with it they form a gloo group (MULTI_CPU).
    # step_scheduler_with_optimizer=False: Accelerate would otherwise step the schedule once per
    # *process* each optimizer step; ours counts optimizer steps, whatever the number of processes.
    accelerator = Accelerator(
        cpu=not on_gpu, mixed_precision="no", gradient_accumulation_steps=train.grad_accum_steps,
        step_scheduler_with_optimizer=False, fsdp_plugin=fsdp,
        deepspeed_plugin=deepspeed_plugin(train, run_dir, on_gpu))
    if fsdp is not None and accelerator.distributed_type == DistributedType.MULTI_CPU:
        route_cpu_processes_to_fsdp(accelerator, fsdp)
    if train.tensor_parallel_size > 1:
        route_processes_to_tensor_parallel(accelerator, train.tensor_parallel_size)
    return accelerator


def _launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def fsdp_plugin(block_class_names: tuple[str, ...]) -> FullyShardedDataParallelPlugin:
    """FSDP2 with one shard unit per decoder block, resharded after forward (ZeRO-3), sharded checkpoints."""
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(block_class_names), state_dict_type="SHARDED_STATE_DICT",
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

    return DeepSpeedPlugin(hf_ds_config=str(path))


def apply_model_options(model: nn.Module, train: TrainConfig, spec: ModelSpec) -> nn.Module:
    """Activation checkpointing and per-block ``torch.compile`` (in place: parameter names do not change)."""
    if train.activation_checkpointing:
        spec.enable_activation_checkpointing(model)
    if train.compile:
        for block in spec.decoder_blocks(model):
            block.compile()
    return model


def is_sharded(accelerator: Accelerator) -> bool:
    """True when parameters are split across processes (FSDP): every rank must then run every forward."""
    return accelerator.distributed_type == DistributedType.FSDP


def route_processes_to_tensor_parallel(accelerator: Accelerator, tensor_parallel_size: int) -> DeviceMesh:
    """Build the ``("dp", "tp")`` device mesh and tell Accelerate the model arrives tensor-parallel.

    Accelerate 1.15's own route, ``Accelerator(parallelism_config=ParallelismConfig(tp_size=...))``,
    refuses CPU processes ("only compatible with ... Multi{Device}", MULTI_CPU is not one) and refuses
    tensor parallelism next to plain data-parallel replicas (it composes TP only with FSDP's
    ``dp_shard``). So the mesh is torch's ``init_device_mesh`` (consecutive ranks form a TP group), and
    the config is handed to the state afterwards, which makes ``prepare`` skip DDP and check the
    model's ``tp_size`` instead. Gradients of the replicas are averaged by
    :func:`sync_data_parallel_gradients`. Raises ConfigError when the processes do not divide evenly.
    """
    world_size = accelerator.num_processes
    if world_size % tensor_parallel_size:
        raise ConfigError(f"train.tensor_parallel_size {tensor_parallel_size} must divide the {world_size} launched "
                          f"process(es); launch a multiple of {tensor_parallel_size} processes "
                          "(train.num_processes) or set tensor_parallel_size: 1.")
    mesh = init_device_mesh(accelerator.device.type, (world_size // tensor_parallel_size, tensor_parallel_size),
                            mesh_dim_names=("dp", "tp"))
    accelerator.state.parallelism_config = ParallelismConfig(tp_size=tensor_parallel_size)
    accelerator.state.device_mesh = mesh
    return mesh


def tensor_parallel_mesh(accelerator: Accelerator) -> DeviceMesh | None:
    """The ``("dp", "tp")`` mesh of a tensor-parallel run, None otherwise."""
    config = accelerator.parallelism_config
    if config is None or not config.tp_enabled:
        return None
    return accelerator.torch_device_mesh


def data_parallel_coordinates(accelerator: Accelerator) -> tuple[int, int]:
    """(data-parallel replicas, this process's replica): the processes of one TP group read the same batch."""
    mesh = tensor_parallel_mesh(accelerator)
    if mesh is None:
        return accelerator.num_processes, accelerator.process_index
    return mesh["dp"].size(), mesh.get_local_rank("dp")


def tensor_parallel_rank(accelerator: Accelerator) -> int:
    """This process's slice within its TP group (0 without tensor parallelism)."""
    mesh = tensor_parallel_mesh(accelerator)
    return 0 if mesh is None else mesh.get_local_rank("tp")


def parallelize_model(model: nn.Module, accelerator: Accelerator, spec: ModelSpec) -> nn.Module:
    """Split every decoder block over the TP group (in place; parameter names do not change). No-op without TP.

    The split is the spec's (Megatron's: column-parallel in, row-parallel out, one all-reduce each; norms and
    the embedding stay whole). Every process built the same full weights; each keeps its slice as a DTensor.
    """
    mesh = tensor_parallel_mesh(accelerator)
    if mesh is None:
        return model
    plan = spec.tensor_parallel_plan(mesh["tp"].size())
    model.to(accelerator.device)  # prepare leaves a model holding DTensors where it is, norms included
    for block in spec.decoder_blocks(model):
        parallelize_module(block, mesh["tp"], plan)
    # What Accelerate's prepare checks (accelerate.utils.get_model_tp_size); a transformers model exposes it as a
    # read-only property over ``_tp_size``.
    read_only = isinstance(getattr(type(model), "tp_size", None), property)
    setattr(model, "_tp_size" if read_only else "tp_size", mesh["tp"].size())
    return model


def sync_data_parallel_gradients(model: nn.Module, accelerator: Accelerator) -> None:
    """Average the gradients over the data-parallel replicas of a TP run (DDP's job elsewhere); else a no-op.

    Collective over each ``dp`` group: one all-reduce of all this process's local gradient slices.
    """
    mesh = tensor_parallel_mesh(accelerator)
    if mesh is None or mesh["dp"].size() == 1:
        return
    with torch.no_grad():
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=mesh["dp"].get_group())
        flat /= mesh["dp"].size()
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's slice of a DTensor (the tensor itself otherwise); call under ``torch.no_grad()``.

    Without autograd ``to_local`` returns the DTensor's own storage, so in-place writes reach the DTensor.
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state_dict(accelerator: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain tensors; collective: every process must call it.

    Under FSDP rank 0 receives the gathered weights (Accelerate); under TP every process gathers each
    DTensor's slices (``full_tensor``).
    """
    state_dict = accelerator.get_state_dict(model)
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in state_dict.items()}
