"""Hugging Face models on 2 processes under a real ``accelerate launch``: DDP and FSDP2 = 1 process, same maths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import ConfigError
from tests.trainer.conftest import MakeRunDir
from tests.trainer.test_hf_models import save_tiny_model, use_hf_model
from tests.trainer.test_parallel import FP32_ATOL, launch, max_weight_difference
from trainer.checkpoint.checkpointer import verify_checkpoint
from trainer.model.hf_model import load_causal_lm_config
from trainer.model.spec import HuggingFaceSpec
from trainer.train import main

SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 2, "eval_batches": 3}


def hf_run_dir(make_run_dir: MakeRunDir, source: Path, name: str, **train: object) -> Path:
    run_dir = make_run_dir(name)
    use_hf_model(run_dir, source, key="from_pretrained", **{**SETTINGS, **train})
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "fsdp"), [("gpt2", False), ("qwen3", True)])
def test_two_processes_equal_one_with_doubled_accumulation(tmp_path: Path, make_run_dir: MakeRunDir,
                                                           model_type: str, fsdp: bool) -> None:
    """DDP (GPT-2: learned positions, Conv1D projections) and FSDP2 per decoder block, found from the model's own
    ``_no_split_modules``, with activation checkpointing (Qwen3: GQA, q/k norms), resumed once mid-way."""
    source = save_tiny_model(tmp_path / "src", model_type)
    options = {"fsdp": True, "activation_checkpointing": True} if fsdp else {}
    run_dir = hf_run_dir(make_run_dir, source, "two", num_processes=2, **options)
    launch(run_dir, 2, until_step=2)
    assert "Resuming from checkpoint at step 2" in launch(run_dir, 2)
    manifest = json.loads((run_dir / "checkpoints" / "step-0000004" / "manifest.json").read_text())["files"]
    assert ("pytorch_model_fsdp_0/__1_0.distcp" in manifest) is fsdp  # sharded: each rank wrote its own part
    assert verify_checkpoint(run_dir / "checkpoints" / "step-0000004") is None

    reference = hf_run_dir(make_run_dir, source, "one", grad_accum_steps=2)
    assert main(["--run-dir", str(reference)]) == 0
    assert max_weight_difference(run_dir, reference) < FP32_ATOL
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["model_type"] == model_type


@pytest.mark.slow
def test_tensor_parallel_follows_the_models_own_tp_plan(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    """Llama's ``base_model_tp_plan`` (q/k/v, gate/up colwise; o, down rowwise) on 2 processes = 1 process."""
    source = save_tiny_model(tmp_path / "src", "llama")
    run_dir = hf_run_dir(make_run_dir, source, "two", num_processes=2, tensor_parallel_size=2, max_steps=2)
    launch(run_dir, 2)
    assert "tensor_parallel/tp_rank_1.safetensors" in json.loads(
        (run_dir / "checkpoints" / "step-0000002" / "manifest.json").read_text())["files"]
    reference = hf_run_dir(make_run_dir, source, "one", max_steps=2)
    assert main(["--run-dir", str(reference)]) == 0
    assert max_weight_difference(run_dir, reference) < FP32_ATOL


def test_a_model_without_a_tp_plan_names_tensor_parallel_size(tmp_path: Path) -> None:
    config = load_causal_lm_config(save_tiny_model(tmp_path / "src", "gpt2", weights=False))
    with pytest.raises(ConfigError, match=r"train\.tensor_parallel_size 2: model_type 'gpt2'.*no tp_plan"):
        HuggingFaceSpec(config, 64).tensor_parallel_plan(2)
