"""Checkpoints: live training state -> ``checkpoints/step-NNNNNNN/`` (+ ``latest``); the newest valid one on resume.

A checkpoint folder holds what ``accelerator.save_state`` writes (``model.safetensors``,
``optimizer.bin``, ``scheduler.bin``, ``random_states_<rank>.pkl``; under FSDP the weights and AdamW
state are sharded torch.distributed.checkpoint folders instead, ``pytorch_model_fsdp_0/`` and
``optimizer_0/``, one ``__<rank>_0.distcp`` file per rank plus ``.metadata``; under tensor parallelism
``tensor_parallel/tp_rank_<t>.safetensors``, one per TP slice, plus ``tensor_parallel/layout.json``,
see :mod:`trainer.checkpoint.tensor_parallel`), then ``trainer_state.json``
(every registered Stateful's ``state_dict()`` as JSON: loop counters, loader position, …) and,
written LAST, ``manifest.json`` with the sha256 of every other file. A folder whose manifest is
missing or does not verify is not a checkpoint. The folder is assembled under a temporary name and
renamed into place, so a killed save never looks finished. With ``train.async_checkpoint`` the same folder is
written by a background thread from a CPU copy of the state (:mod:`trainer.checkpoint.writer`), one save at a time:
the next save, a restore, and the end of training wait for it, and its failure is raised there.

Deliberately not used: Accelerate's ``automatic_checkpoint_naming`` (its counter restarts at 0 in a
new process and prunes the wrong folder, docs/library-facts.md) and ``register_for_checkpointing`` (it unpickles
with ``weights_only=False``); our own state goes through JSON instead.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list

from core.bucket.run_dir import publish_working_copy, share_checkpoint_parts
from core.errors import CheckpointError
from core.files.atomic import TEMP_PREFIX, read_json, sha256_file
from core.layout import RELATIVE, run_key
from core.rundir import RunPaths, path_inside_run
from trainer.checkpoint.dcp_metadata import unsafe_metadata
from trainer.checkpoint.layout import MANIFEST_NAME, list_checkpoints
from trainer.checkpoint.tensor_parallel import (
    TENSOR_PARALLEL_DIR,
    TENSOR_PARALLEL_LAYOUT,
    TensorParallelShards,
    model_and_optimizer_hidden,
)
from trainer.checkpoint.writer import (
    BackgroundSave,
    StateSnapshot,
    fsync_files,
    hold_at_publish_gate,
    pause_for_drill,
    snapshot_state,
)

CHECKPOINT_VERSION = 1
TRAINER_STATE_NAME = "trainer_state.json"
PUBLISHED_AT_SAVE = (f"{run_key(RELATIVE.metrics)}/", f"{run_key(RELATIVE.checkpoints)}/")
"""What a checkpoint save publishes of a bucket run dir's working copy (``latest`` last)."""
FSDP_MODEL_METADATA = "pytorch_model_fsdp_0/.metadata"
FSDP_OPTIMIZER_METADATA = "optimizer_0/.metadata"
REQUIRED_FILES = (("model.safetensors", FSDP_MODEL_METADATA, f"{TENSOR_PARALLEL_DIR}/tp_rank_0.safetensors"),
                  ("optimizer.bin", FSDP_OPTIMIZER_METADATA, TENSOR_PARALLEL_LAYOUT), (TRAINER_STATE_NAME,))
"""Each group needs one of its files: weights and optimizer state whole (DDP), sharded (FSDP) or split (TP)."""


class Stateful(Protocol):
    """Anything resumable: a JSON-serialisable ``state_dict()`` and its inverse."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def write_manifest(paths: RunPaths, folder: Path, step: int) -> None:
    """Record the sha256 and size of every file in ``folder``; call it after everything else is written."""
    files = {
        path.relative_to(folder).as_posix(): {"sha256": sha256_file(path), "num_bytes": path.stat().st_size}
        for path in sorted(folder.rglob("*")) if path.is_file() and path.name != MANIFEST_NAME
    }
    paths.write_json(folder / MANIFEST_NAME, {"version": CHECKPOINT_VERSION, "step": step, "files": files})


def verify_checkpoint(folder: Path) -> str | None:
    """None when ``folder`` is a complete, intact checkpoint; otherwise what is wrong with it."""
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = read_json(manifest_path)
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return f"unreadable manifest.json ({err})"
    missing = [" or ".join(group) for group in REQUIRED_FILES if not any(name in files for name in group)]
    if missing:
        return f"manifest lacks {missing}"
    if not path_inside_run(folder.parent, folder):
        return "the folder resolves (through a symlink) outside the checkpoints folder"
    for name, entry in files.items():
        path = folder / name
        # A checkpoint is data from whoever made the run dir: it may name only its own files.
        if Path(name).is_absolute() or ".." in Path(name).parts or not path_inside_run(folder, path):
            return f"{name} lies outside the checkpoint folder (an absolute path, '..' or a symlink out)"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["num_bytes"] or sha256_file(path) != entry["sha256"]:
            return f"{name} does not match its sha256 in manifest.json (corrupted or modified)"
        if path.name == ".metadata" and (problem := unsafe_metadata(path)) is not None:
            return f"{name}: {problem}"
    return None


class Checkpointer:
    """Saves and restores the accelerator's objects plus ``states`` ({name: Stateful}) in the run's ``checkpoints/``.

    Rank 0 writes the shared files.
    """

    def __init__(self, accelerator: Accelerator, paths: RunPaths, keep_last: int,
                 states: dict[str, Stateful], shards: TensorParallelShards | None = None,
                 async_save: bool = False) -> None:
        """``shards``: the model and optimizer of a tensor-parallel run, which Accelerate cannot save.

        ``async_save``: write in a background thread from a CPU copy (not with FSDP, DeepSpeed or ``shards``).
        """
        self.accelerator = accelerator
        self.paths = paths
        self.checkpoints_dir = paths.checkpoints
        self.keep_last = keep_last
        self.states = states
        self.shards = shards
        self.async_save = async_save
        self._pending: BackgroundSave | None = None
        if async_save and (shards is not None or accelerator.distributed_type in (DistributedType.FSDP,
                                                                                   DistributedType.DEEPSPEED)):
            raise CheckpointError("train.async_checkpoint works with whole (DDP or single-process) models only, "
                                  "not with train.fsdp, train.deepspeed_config or train.tensor_parallel_size > 1; "
                                  "set async_checkpoint: false.")

    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step`` and return its folder; all ranks must call this together.

        With ``async_save`` the folder is published later, by a background thread on rank 0; this returns once the
        state is copied (after waiting for the previous background save, whose failure is raised here).
        """
        self.wait_for_pending()
        target = self.paths.checkpoint(step)
        staging = self.checkpoints_dir / f"{TEMP_PREFIX}{target.name}"  # same name on every rank
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        try:
            snapshot = snapshot_state(self.accelerator, staging) if self.async_save else None
            if not self.async_save:
                self._save_training_state(staging)
            self.accelerator.wait_for_everyone()  # every rank's random_states_<rank>.pkl is in place
            share_checkpoint_parts(self.paths.root, staging, is_main=self.accelerator.is_main_process,
                                   is_local_main=self.accelerator.is_local_main_process,
                                   barrier=self.accelerator.wait_for_everyone)  # machines apart, one bucket
            if self.accelerator.is_main_process:
                trainer_state = {"version": CHECKPOINT_VERSION, "step": step,
                                 "states": {name: obj.state_dict() for name, obj in self.states.items()}}
                if snapshot is not None:  # frozen as JSON now: the states go on changing during the write
                    self._start_background_save(snapshot, json.loads(json.dumps(trainer_state)), staging, target)
                    return target
                self.paths.write_json(staging / TRAINER_STATE_NAME, trainer_state)
                write_manifest(self.paths, staging, step)
        except Exception as err:
            # A full disk shows up as OSError, torch.save's "iostream error" RuntimeError or a SafetensorError:
            # drop the half-written folder (the previous checkpoint stays the newest) and say where and how much.
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(self._save_failed_message(target, err)) from err
        if self.async_save:
            return target  # the other ranks' part is written; rank 0 publishes it in the background
        if self.accelerator.is_main_process:
            self._publish(staging, target, step)
        self.accelerator.wait_for_everyone()
        return target

    def _publish(self, staging: Path, target: Path, step: int) -> None:
        """Rename the complete ``staging`` folder into place, then point ``latest`` at it and prune (rank 0)."""
        hold_at_publish_gate()
        self.paths.replace_folder(staging, target)
        self.paths.write_json(self.paths.latest_checkpoint, {"step": step, "path": target.name})
        self._prune()
        publish_working_copy(self.paths.root, *PUBLISHED_AT_SAVE)  # a bucket run dir's: `latest` last

    def _start_background_save(self, snapshot: StateSnapshot, trainer_state: dict[str, Any], staging: Path,
                               target: Path) -> None:
        """Rank 0: write ``snapshot`` and ``trainer_state`` into ``staging``, fsync, manifest, publish, in a thread."""
        step = trainer_state["step"]

        def write_and_publish() -> None:
            snapshot.write(staging)
            pause_for_drill()
            self.paths.write_json(staging / TRAINER_STATE_NAME, trainer_state)
            fsync_files(staging)
            write_manifest(self.paths, staging, step)
            self._publish(staging, target, step)

        def describe_error(err: Exception) -> str:
            shutil.rmtree(staging, ignore_errors=True)
            return self._save_failed_message(target, err)

        self._pending = BackgroundSave(target.name, write_and_publish, describe_error)

    def wait_for_pending(self) -> None:
        """Wait for the background save in flight, if any; CheckpointError on every rank when it failed.

        Collective (all ranks call it together): rank 0 tells the others whether its save failed, so no rank is
        left waiting in the next collective while rank 0 raises.
        """
        if not self.async_save:
            return
        error = [self._join_pending()]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(error)
        if error[0] is not None:
            raise CheckpointError(error[0])

    def _join_pending(self) -> str | None:
        """Wait for this rank's background save (rank 0 only has one); its error message, once."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.join()

    def close(self) -> str | None:
        """Let a background save in flight finish (training stopped with an error); returns its failure, if any.

        Not collective: called on the way out, when the other ranks may already be gone.
        """
        return self._join_pending()

    def _save_training_state(self, folder: Path) -> None:
        if self.shards is None:
            self.accelerator.save_state(str(folder))
            return
        with model_and_optimizer_hidden(self.accelerator):
            self.accelerator.save_state(str(folder))  # the LR schedule and the RNG states
        self.shards.save(folder, self.paths)

    def _load_training_state(self, folder: Path) -> None:
        if self.shards is None:
            self.accelerator.load_state(str(folder))
            return
        with model_and_optimizer_hidden(self.accelerator):
            self.accelerator.load_state(str(folder))
        self.shards.load(folder)

    def _save_failed_message(self, target: Path, err: Exception) -> str:
        """One line: the checkpoint that could not be saved, why, the room one takes (the previous one's size)."""
        previous = list_checkpoints(self.checkpoints_dir)
        room = ""
        if previous:
            num_bytes = sum(path.stat().st_size for path in previous[-1][1].rglob("*") if path.is_file())
            room = f"a checkpoint of this run takes about {num_bytes:,} bytes, "
        free = shutil.disk_usage(self.checkpoints_dir).free
        reason = " ".join(str(err).split())[:200]
        resume = f"step {previous[-1][0]}" if previous else "step 0"
        return (f"{target}: saving the checkpoint failed ({type(err).__name__}: {reason}); {room}{free:,} bytes are "
                f"free there. Free space (or lift the file-size limit, `ulimit -f`) and re-run: training resumes "
                f"from {resume}.")

    def latest_name(self) -> str | None:
        """``checkpoints/step-NNNNNNN`` of the newest checkpoint folder (relative to the run dir), or None."""
        if self._pending is not None:
            self._pending.join()  # its error stays for wait_for_pending to raise
        found = list_checkpoints(self.checkpoints_dir)
        return found[-1][1].relative_to(self.paths.root).as_posix() if found else None

    def _prune(self) -> None:
        for _, folder in list_checkpoints(self.checkpoints_dir)[:-self.keep_last]:
            self.paths.remove_folder(folder)

    def load_latest(self) -> int | None:
        """Restore the newest checkpoint that verifies and return its step; None when there is none.

        A corrupt or half-written newer one is skipped with a warning naming it. Raises CheckpointError
        when checkpoints exist but none verifies.
        """
        chosen = self._choose_newest_valid()
        if chosen is None:
            return None
        step, folder = chosen
        self._restore(folder)
        return step

    def restore_weights_of_latest(self, keep: tuple[str, ...]) -> tuple[int, dict[str, Any]] | None:
        """Roll back: restore the newest valid checkpoint except the ``keep`` states (which go on as they are).

        Model, optimizer, LR schedule, RNG and the other states are restored. Returns (its step, its saved
        ``loader`` state), or None when there is no checkpoint; raises CheckpointError as :meth:`load_latest`.
        """
        chosen = self._choose_newest_valid()
        if chosen is None:
            return None
        step, folder = chosen
        saved = self._restore(folder, keep=keep)
        return step, saved.get("loader", {})

    def _choose_newest_valid(self) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies (rank 0 hashes the files; every rank gets the same answer)."""
        self.wait_for_pending()  # the newest checkpoint may still be being written
        chosen: list[Any] = [None]
        if self.accelerator.is_main_process:
            self.paths.remove_stale_temps(self.checkpoints_dir)
            try:
                chosen[0] = self._newest_valid()
            except CheckpointError as err:
                chosen[0] = str(err)
        broadcast_object_list(chosen)
        if isinstance(chosen[0], str):
            raise CheckpointError(chosen[0])  # on every rank, so none is left waiting
        return None if chosen[0] is None else (int(chosen[0][0]), Path(chosen[0][1]))

    def load_step(self, step: int) -> None:
        """Restore the checkpoint of ``step`` (an evaluation of a chosen checkpoint).

        Raises CheckpointError naming the folder when it is missing or does not verify against its manifest.
        """
        self.wait_for_pending()
        folder = self.paths.checkpoint(step)
        problem: list[Any] = [None]
        if self.accelerator.is_main_process:
            problem[0] = "no such checkpoint" if not folder.is_dir() else verify_checkpoint(folder)
        broadcast_object_list(problem)
        if problem[0] is not None:
            raise CheckpointError(f"{folder}: {problem[0]}; it cannot be evaluated: restore a good copy, or "
                                  "evaluate another checkpoint (`tokenmill eval RUN_DIR --checkpoint STEP`).")
        self._restore(folder)

    def _newest_valid(self) -> tuple[int, str] | None:
        found = list_checkpoints(self.checkpoints_dir)
        bad: list[Path] = []
        for step, folder in reversed(found):
            problem = verify_checkpoint(folder)
            if problem is None:
                # Newer bad ones are moved aside only now that an older good one exists; otherwise
                # they stay, so every retry fails the same way until someone looks.
                for newer in bad:
                    set_aside(newer)
                return step, str(folder)
            bad.append(folder)
            warnings.warn(f"skipping checkpoint {folder}: {problem}; it is renamed to {folder.name}.invalid "
                          "if an older checkpoint verifies", stacklevel=3)
        if found:
            raise CheckpointError(
                f"{self.checkpoints_dir}: none of the {len(found)} checkpoints verifies against its manifest.json; "
                "restore a good copy, or delete the folder to start training from scratch.")
        return None

    def _restore(self, folder: Path, keep: tuple[str, ...] = ()) -> dict[str, Any]:
        """Load ``folder`` into the accelerator's objects and the states (except ``keep``); returns its saved states."""
        trainer_state = read_json(folder / TRAINER_STATE_NAME)
        if trainer_state.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"{folder}: checkpoint version {trainer_state.get('version')!r}, this tokenmill "
                                  f"reads {CHECKPOINT_VERSION}; delete checkpoints/ to start over.")
        missing = [name for name in self.states if name not in trainer_state["states"]]
        if missing:
            raise CheckpointError(f"{folder}: trainer_state.json lacks {missing}; it was written by another "
                                  "trainer version: delete checkpoints/ to start over.")
        self._check_sharding(folder)
        for name, obj in self.states.items():  # validate our own state before touching the weights
            if name not in keep:
                obj.load_state_dict(trainer_state["states"][name])
        self._load_training_state(folder)
        # Checkpoints sit on optimizer-step boundaries; reset Accelerate's micro-step counter so a resume
        # with another grad_accum_steps (e.g. fewer processes) syncs on the right micro-batch.
        self.accelerator.step = 0
        return trainer_state["states"]

    def _check_sharding(self, folder: Path) -> None:
        saved_sharded = (folder / FSDP_MODEL_METADATA).is_file()
        sharded_now = self.accelerator.distributed_type == DistributedType.FSDP
        if saved_sharded != sharded_now:
            saved, now = ("FSDP", "unsharded") if saved_sharded else ("unsharded", "FSDP")
            raise CheckpointError(f"{folder} holds {saved} weights but this run is {now}; set train.fsdp back to "
                                  f"{str(saved_sharded).lower()} to resume, or delete checkpoints/ to start over.")
        layout = folder / TENSOR_PARALLEL_LAYOUT
        saved_size = read_json(layout)["tensor_parallel_size"] if layout.is_file() else 1
        size_now = 1 if self.shards is None else self.shards.tensor_parallel_size
        if saved_size != size_now:
            raise CheckpointError(f"{folder} was saved with train.tensor_parallel_size {saved_size}, this run has "
                                  f"{size_now}; set it back to {saved_size} (and launch a multiple of that many "
                                  "processes) to resume, or delete checkpoints/ to start over.")


def set_aside(folder: Path) -> Path:
    """Rename a bad checkpoint to ``<name>.invalid`` (kept for inspection, never loaded or counted by pruning)."""
    aside = folder.with_name(f"{folder.name}.invalid")
    shutil.rmtree(aside, ignore_errors=True)
    folder.rename(aside)
    return aside
