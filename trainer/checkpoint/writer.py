"""Background checkpoint writes (``train.async_checkpoint``): a CPU copy of the state at the step boundary, written
to disk by one thread while training goes on.

The main thread copies the model's and AdamW's tensors (and the LR schedule) into CPU memory: a memcpy on CPU, a
device-to-host copy on GPU, so later steps cannot change what is written. The small files (RNG states, ``scaler.pt``)
are written at once by Accelerate itself. A :class:`BackgroundSave` thread then writes the copy in Accelerate's own
file layout (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``: ``accelerator.load_state`` reads it back),
and the caller's ``finish`` (trainer_state.json, manifest.json, the rename, ``latest``, pruning) runs in that thread
after it. The thread runs no collectives: a gloo collective from a second thread can deadlock the main one's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, save

WRITE_DELAY_ENV = "TOKENMILL_CHECKPOINT_WRITE_DELAY_S"
"""Test and drill knob: seconds a background save sleeps before each file it writes (unset = none). It makes the
in-flight window long and deterministic, so ``kill -9`` during a background save can be tested (and rehearsed)."""


def copy_to_cpu(obj: Any, memo: dict[tuple[Any, ...], torch.Tensor] | None = None) -> Any:
    """A deep copy of ``obj`` (dicts, lists, tuples, tensors, plain values) whose tensors live in fresh CPU memory.

    The same view of one storage met twice (a tied weight's two names) is copied once and shared in the copy, so
    the files written from it equal those written from the live state (Accelerate drops a tied weight's duplicate
    by its storage). Tensor copies, not storage copies: ``UntypedStorage.clone`` took ~20 ms for 64 kB here.
    """
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.dtype, tuple(obj.size()),
               obj.stride())
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, OrderedDict):
        return OrderedDict((key, copy_to_cpu(value, memo)) for key, value in obj.items())
    if isinstance(obj, dict):
        return {key: copy_to_cpu(value, memo) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(copy_to_cpu(value, memo) for value in obj)
    return obj  # numbers, strings, None, bools: immutable


@dataclass(frozen=True)
class StateSnapshot:
    """The model weights, optimizer and LR-schedule state of one step boundary, in CPU memory (rank 0 only)."""

    weights: Any
    optimizer: Any
    scheduler: Any

    def write(self, folder: Path) -> None:
        """Write the copy as ``accelerator.save_state`` lays it out; sleeps per file when WRITE_DELAY_ENV is set."""
        files = ((SAFE_WEIGHTS_NAME, self.weights, True), (f"{OPTIMIZER_NAME}.bin", self.optimizer, False),
                 (f"{SCHEDULER_NAME}.bin", self.scheduler, False))
        for name, state, safe in files:
            pause_for_drill()
            save(state, folder / name, safe_serialization=safe)

PUBLISH_GATE_ENV = "TOKENMILL_CHECKPOINT_PUBLISH_GATE"
"""Test and drill knob: a file's path; while that file exists, rank 0 waits with a complete checkpoint folder just
before publishing it (the rename, ``latest``, pruning), so a kill at that very moment can be tested."""


def hold_at_publish_gate() -> None:
    """Wait while the PUBLISH_GATE_ENV file exists (tests and kill drills only; unset = no wait)."""
    gate = os.environ.get(PUBLISH_GATE_ENV)
    while gate and Path(gate).exists():
        time.sleep(0.01)


def pause_for_drill() -> None:
    """Sleep WRITE_DELAY_ENV seconds when it is set (tests and kill drills only)."""
    delay = os.environ.get(WRITE_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def snapshot_state(accelerator: Accelerator, folder: Path) -> StateSnapshot | None:
    """At a step boundary: write this rank's small files into ``folder`` and copy the rest into CPU memory.

    Every rank writes ``random_states_<rank>.pkl`` (and ``scaler.pt`` under fp16) now, through Accelerate, as
    ``save_state`` would. Rank 0 alone writes the weights, optimizer and schedule (as ``save_state`` does without
    FSDP), so only rank 0 gets a snapshot; the others get None. A single model and optimizer, as trainer.train
    prepares them.
    """
    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step,
                           accelerator.scaler, save_on_each_node=accelerator.project_configuration.save_on_each_node)
    if not accelerator.is_main_process:
        return None
    (model,), (optimizer,), (scheduler,) = accelerator._models, accelerator._optimizers, accelerator._schedulers
    memo: dict[tuple[Any, ...], torch.Tensor] = {}
    return StateSnapshot(copy_to_cpu(accelerator.get_state_dict(model, unwrap=False), memo),
                         copy_to_cpu(optimizer.state_dict(), memo), copy_to_cpu(scheduler.state_dict(), memo))


def fsync_files(folder: Path) -> None:
    """Flush every file under ``folder`` to disk, then the folder itself (before its manifest says it is whole)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lower_this_threads_priority() -> None:
    """Run the calling thread at the lowest CPU priority (Linux: a nice value is per thread), so the writer's
    serialisation and hashing yield the cores to the training step's threads instead of slowing every step;
    elsewhere, or when not permitted, the thread keeps its priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class BackgroundSave:
    """One checkpoint being written by a thread; :meth:`join` waits for it and returns its error message, if any."""

    def __init__(self, name: str, work: Callable[[], None], describe_error: Callable[[Exception], str]) -> None:
        """``work`` writes and publishes the checkpoint; ``describe_error`` turns its exception into the one-line
        CheckpointError message (computed in the thread, next to the failure)."""
        self.error: str | None = None
        self._work, self._describe_error = work, describe_error
        # Not a daemon: an interpreter that exits (an error in the loop) first lets the checkpoint finish.
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-{name}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        lower_this_threads_priority()
        try:
            self._work()
        except Exception as err:  # any failure is reported on the main thread as a CheckpointError
            self.error = self._describe_error(err)

    def join(self) -> str | None:
        """Wait until the write is done (or failed); None when the checkpoint is published."""
        self._thread.join()
        return self.error
