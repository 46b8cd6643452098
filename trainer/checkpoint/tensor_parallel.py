"""Tensor-parallel checkpoints: each TP slice's weights and AdamW state as safetensors, never pickle.

Accelerate's ``save_state`` cannot save DTensor parameters, so :class:`trainer.checkpoint.checkpointer.Checkpointer`
lets Accelerate write the scheduler and RNG files and this module the model and optimizer slices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from core.errors import CheckpointError
from core.files.atomic import read_json
from core.rundir import RunPaths
from trainer.parallel.accelerator import (
    data_parallel_coordinates,
    local_tensor,
    tensor_parallel_mesh,
    tensor_parallel_rank,
)
from trainer.precision import unwrap_optimizer

TENSOR_PARALLEL_DIR = "tensor_parallel"
TENSOR_PARALLEL_LAYOUT = f"{TENSOR_PARALLEL_DIR}/layout.json"


class TensorParallelShards:
    """The weights and AdamW state of a tensor-parallel model, one safetensors file per TP slice (no pickle).

    The processes of the first data-parallel replica each write ``tensor_parallel/tp_rank_<t>.safetensors``
    with their local slices (``model.<name>``, ``optimizer.<name>.<state key>``; norms and the embedding
    whole); rank 0 writes ``tensor_parallel/layout.json`` (the TP size and AdamW's hyper-parameters).
    On resume every process reads the file of its own slice: the TP size must match, the data-parallel
    size could change (not tested).
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, optimizer: Any) -> None:
        mesh = tensor_parallel_mesh(accelerator)
        assert mesh is not None, "TensorParallelShards needs a tensor-parallel accelerator"
        self.accelerator, self.model, self.optimizer = accelerator, accelerator.unwrap_model(model), optimizer
        self.tensor_parallel_size = mesh["tp"].size()
        self.tp_rank, self.dp_rank = tensor_parallel_rank(accelerator), data_parallel_coordinates(accelerator)[1]

    def shard_path(self, folder: Path) -> Path:
        return folder / TENSOR_PARALLEL_DIR / f"tp_rank_{self.tp_rank}.safetensors"

    def save(self, folder: Path, paths: RunPaths) -> None:
        """Write this slice's file (first replica only) and, on rank 0, layout.json, into ``folder`` of the run."""
        if self.dp_rank == 0:
            with paths.atomic_write(self.shard_path(folder)) as tmp:
                save_file(self.local_tensors(), tmp, metadata={"format": "pt"})
        if self.accelerator.is_main_process:
            groups = [{key: value for key, value in group.items() if key != "params"}
                      for group in unwrap_optimizer(self.optimizer).param_groups]
            paths.write_json(folder / TENSOR_PARALLEL_LAYOUT,
                             {"tensor_parallel_size": self.tensor_parallel_size, "param_groups": groups})

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This process's slices of every parameter and of its AdamW state, as contiguous CPU tensors."""
        optimizer, tensors = unwrap_optimizer(self.optimizer), {}
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                tensors[f"model.{name}"] = local_tensor(param)
                for key, value in optimizer.state.get(param, {}).items():
                    tensors[f"optimizer.{name}.{key}"] = local_tensor(value)
        return {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}

    def load(self, folder: Path) -> None:
        """Copy this slice's saved weights into the model and set the AdamW state; CheckpointError on a mismatch."""
        path = self.shard_path(folder)
        try:
            saved = load_file(path)
        except (OSError, SafetensorError) as err:
            raise CheckpointError(f"{path}: cannot read this process's tensor-parallel slice ({err}); "
                                  "delete checkpoints/ to start over.") from None
        optimizer = unwrap_optimizer(self.optimizer)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                local_tensor(param).copy_(_saved_tensor(saved, f"model.{name}", local_tensor(param), path))
                prefix = f"optimizer.{name}."
                optimizer.state[param] = {key[len(prefix):]: _placed_like(param, key[len(prefix):], value)
                                          for key, value in saved.items() if key.startswith(prefix)}
        layout = read_json(folder / TENSOR_PARALLEL_LAYOUT)
        for group, saved_group in zip(optimizer.param_groups, layout["param_groups"], strict=True):
            group.update({key: tuple(value) if isinstance(value, list) else value
                          for key, value in saved_group.items()})


def _saved_tensor(saved: dict[str, torch.Tensor], name: str, like: torch.Tensor, path: Path) -> torch.Tensor:
    if name not in saved or saved[name].shape != like.shape:
        found = tuple(saved[name].shape) if name in saved else "nothing"
        raise CheckpointError(f"{path}: {name} holds {found}, this process needs {tuple(like.shape)}; the "
                              "checkpoint comes from another model or layout: delete checkpoints/ to start over.")
    return saved[name]


def _placed_like(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """A saved AdamW state slice placed like ``param``; ``step`` stays where AdamW keeps it (a CPU scalar)."""
    if key == "step":
        return value
    value = value.to(param.device)
    if not isinstance(param, DTensor):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


@contextlib.contextmanager
def model_and_optimizer_hidden(accelerator: Accelerator) -> Iterator[None]:
    """Accelerate's save_state/load_state for everything but the model and optimizer (TensorParallelShards's job).

    Accelerate 1.15's ``save_state`` fails on DTensor parameters ("Attempted to access the data pointer on
    an invalid python storage"), and it writes ``optimizer.state_dict()`` from rank 0 only, i.e. rank 0's
    slices; the scheduler and RNG files it writes are right.
    """
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers
