"""trainer/checkpoint/checkpointer.py: layout, manifest written last, newest *valid* checkpoint restored, pruning,
pointer."""

from __future__ import annotations

import json
import resource
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.errors import CheckpointError
from core.rundir import RunPaths
from tests.trainer.conftest import SEQ_LEN, TEST_DIMS, fresh_accelerator
from trainer.checkpoint.checkpointer import Checkpointer, list_checkpoints, verify_checkpoint
from trainer.checkpoint.writer import snapshot_state
from trainer.config import ModelDims, TrainConfig
from trainer.loop import LoopCounters
from trainer.model.llama import ModelShape, build_model
from trainer.optim import build_lr_scheduler, build_optimizer

SHAPE = ModelShape(ModelDims(**TEST_DIMS), vocab_size=64, max_seq_len=SEQ_LEN)
TRAIN = TrainConfig(lr=1e-2, warmup_steps=1, max_steps=10)


@dataclass
class Setup:
    """A prepared model/optimizer/scheduler plus loop counters, checkpointed into ``folder``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    counters: LoopCounters
    checkpointer: Checkpointer

    def train_step(self) -> None:
        tokens = torch.randint(0, SHAPE.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(
            self.counters.step))
        loss = self.model(tokens, tokens)
        self.checkpointer.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.counters.step += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.model.state_dict().items()}


def make_setup(run_dir: Path, keep_last: int = 3, seed: int = 0, async_save: bool = False) -> Setup:
    """Checkpointed into ``run_dir/checkpoints`` (``async_save``: by a background thread)."""
    accelerator = fresh_accelerator(TRAIN)
    model = build_model(SHAPE, seed=seed)
    optimizer = build_optimizer(model, TRAIN)
    model, optimizer, _ = accelerator.prepare(model, optimizer, build_lr_scheduler(optimizer, TRAIN))
    counters = LoopCounters()
    return Setup(model, optimizer, counters, Checkpointer(accelerator, RunPaths(run_dir), keep_last,
                                                              {"loop": counters}, async_save=async_save))


def test_save_writes_the_documented_layout(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    setup.train_step()
    folder = setup.checkpointer.save(1)
    assert folder == tmp_path / "checkpoints" / "step-0000001"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["manifest.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                     "scheduler.bin", "trainer_state.json"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [n for n in names if n != "manifest.json"]
    assert json.loads((folder / "trainer_state.json").read_text())["states"]["loop"] == {
        "step": 1, "tokens_seen": 0, "loss_tokens_seen": 0, "skipped_steps": 0, "nonfinite_in_a_row": 0,
        "spike_steps": 0, "spikes_in_a_row": 0, "rollbacks": 0, "recent_losses": []}
    assert json.loads((tmp_path / "checkpoints" / "latest").read_text()) == {"path": "step-0000001", "step": 1}
    assert verify_checkpoint(folder) is None
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")] == []


def test_restore_gives_back_weights_optimizer_and_counters(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    for _ in range(2):
        setup.train_step()
    setup.checkpointer.save(2)
    saved_weights, saved_optimizer = setup.weights(), setup.optimizer.state_dict()
    restored = make_setup(tmp_path, seed=99)  # different init: everything must come from the checkpoint
    assert restored.checkpointer.load_latest() == 2
    assert restored.counters.step == 2
    assert all(torch.equal(saved_weights[k], v) for k, v in restored.weights().items())
    exp_avg = restored.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, saved_optimizer["state"][0]["exp_avg"])


def test_async_save_writes_the_step_boundary_state_while_training_goes_on(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, async_save=True)
    setup.train_step()
    saved_weights = setup.weights()
    saved_exp_avg = setup.optimizer.state_dict()["state"][0]["exp_avg"].clone()
    # The copy a background save writes from, taken at the step boundary, then written after two more steps.
    folder = tmp_path / "snapshot"
    folder.mkdir()
    snapshot = snapshot_state(setup.checkpointer.accelerator, folder)
    for _ in range(2):
        setup.train_step()  # changes the live weights and AdamW moments in place
    snapshot.write(folder)
    assert not any(torch.equal(saved_weights[k], v) for k, v in setup.weights().items() if "norm" not in k)
    written = load_file(folder / "model.safetensors")
    assert written.keys() == saved_weights.keys()
    assert all(torch.equal(saved_weights[k], v) for k, v in written.items())
    written_optimizer = torch.load(folder / "optimizer.bin", weights_only=True)
    assert torch.equal(written_optimizer["state"][0]["exp_avg"], saved_exp_avg)
    # Through the Checkpointer: saved in the background, published once written, restored whole.
    setup.checkpointer.save(3)
    setup.checkpointer.wait_for_pending()
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-0000003") is None
    assert json.loads((tmp_path / "checkpoints" / "latest").read_text())["step"] == 3
    restored = make_setup(tmp_path, seed=99)
    assert restored.checkpointer.load_latest() == 3
    assert all(torch.equal(setup.weights()[k], v) for k, v in restored.weights().items())


def test_a_failed_background_save_raises_one_line_on_the_next_wait_and_keeps_the_previous(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, async_save=True)
    setup.checkpointer.save(1)
    setup.checkpointer.wait_for_pending()
    setup.train_step()
    weights_size = (tmp_path / "checkpoints" / "step-0000001" / "model.safetensors").stat().st_size
    # A file-size limit below the weights' size: the background write fails as on a full disk (test_full_disk).
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (weights_size // 2, previous_limit[1]))
    try:
        setup.checkpointer.save(2)  # the RNG file (a few kB) is written now; the weights in the background
        with pytest.raises(CheckpointError) as failure:
            setup.checkpointer.wait_for_pending()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    message = str(failure.value)
    assert "\n" not in message and "step-0000002" in message and "bytes are free" in message, message
    assert "training resumes from step 1" in message
    assert [step for step, _ in list_checkpoints(tmp_path / "checkpoints")] == [1]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-0000001") is None
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")] == []
    setup.checkpointer.wait_for_pending()  # reported once; the next save goes ahead
    setup.checkpointer.save(2)
    setup.checkpointer.wait_for_pending()
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-0000002") is None


def test_corrupt_newest_is_skipped_with_a_warning_and_the_previous_one_used(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    setup.train_step()
    setup.checkpointer.save(1)
    weights_at_1 = setup.weights()
    setup.train_step()
    newest = setup.checkpointer.save(2)
    weights_file = newest / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # flip one bit inside the tensor data
    weights_file.write_bytes(bytes(data))
    assert "model.safetensors does not match" in verify_checkpoint(newest)
    restored = make_setup(tmp_path, seed=5)
    with pytest.warns(UserWarning, match="step-0000002"):
        assert restored.checkpointer.load_latest() == 1
    assert restored.counters.step == 1
    assert all(torch.equal(weights_at_1[k], v) for k, v in restored.weights().items())
    assert [step for step, _ in list_checkpoints(tmp_path / "checkpoints")] == [1]  # the bad one is set aside
    assert (tmp_path / "checkpoints" / "step-0000002.invalid" / "model.safetensors").is_file()
    restored.train_step()
    restored.checkpointer.save(2)  # the next save of that step is not blocked by the bad copy
    assert verify_checkpoint(tmp_path / "checkpoints" / "step-0000002") is None


def test_half_written_checkpoint_is_skipped_and_stale_temps_removed(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    setup.checkpointer.save(3)
    half = setup.checkpointer.save(4)
    (half / "manifest.json").unlink()  # killed before the manifest (written last) was in place
    (tmp_path / "checkpoints" / ".tmp-step-0000005").mkdir()  # a save killed before its rename
    restored = make_setup(tmp_path)
    with pytest.warns(UserWarning, match=r"step-0000004: no manifest\.json"):
        assert restored.checkpointer.load_latest() == 3
    assert not (tmp_path / "checkpoints" / ".tmp-step-0000005").exists()


def test_no_valid_checkpoint_is_an_error_and_no_checkpoint_is_a_fresh_start(tmp_path: Path) -> None:
    assert make_setup(tmp_path / "empty").checkpointer.load_latest() is None
    setup = make_setup(tmp_path / "broken")
    folder = setup.checkpointer.save(1)
    (folder / "optimizer.bin").write_bytes(b"garbage")
    for _ in range(2):  # a retry fails the same way: a bad checkpoint is never silently dropped
        with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="none of the 1 checkpoints verifies"):
            make_setup(tmp_path / "broken").checkpointer.load_latest()


def test_keep_last_prunes_the_oldest(tmp_path: Path) -> None:
    setup = make_setup(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        setup.counters.step = step
        setup.checkpointer.save(step)
    assert [step for step, _ in list_checkpoints(tmp_path / "checkpoints")] == [3, 4]
    assert json.loads((tmp_path / "checkpoints" / "latest").read_text())["step"] == 4


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    setup = make_setup(tmp_path)
    setup.checkpointer.save(1)
    setup.train_step()
    setup.counters.step = 1
    folder = setup.checkpointer.save(1)
    assert verify_checkpoint(folder) is None
    restored = make_setup(tmp_path)
    restored.checkpointer.load_latest()
    assert all(torch.equal(v, restored.weights()[k]) for k, v in setup.weights().items())


@pytest.mark.parametrize("escape", ["absolute", "dotdot", "symlinked_file", "symlinked_folder"])
def test_a_checkpoint_naming_files_outside_itself_does_not_verify(tmp_path: Path, escape: str) -> None:
    """A run dir is data from whoever made it: its checkpoint may point only at its own files, even when an
    outside file has the right bytes (the manifest's sha256 then matches)."""
    setup = make_setup(tmp_path)
    setup.train_step()
    folder = setup.checkpointer.save(1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = manifest["files"]["model.safetensors"]
    if escape == "absolute":
        manifest["files"][str(outside / "model.safetensors")] = entry
    elif escape == "dotdot":
        manifest["files"]["../../elsewhere/model.safetensors"] = entry
    (folder / "manifest.json").write_text(json.dumps(manifest))
    if escape == "symlinked_file":
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    if escape == "symlinked_folder":
        for path in folder.iterdir():
            (outside / path.name).write_bytes(path.read_bytes())
        folder.rename(tmp_path / "moved")
        folder.symlink_to(outside)
    assert "outside" in verify_checkpoint(folder)
