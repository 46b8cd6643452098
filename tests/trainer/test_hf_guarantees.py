"""The built-in model's guarantees, held by Hugging Face models: precision, compile, kill -9, elastic resume, MFU.

Each mirrors the built-in test (test_precision.py, test_model.py, test_resume.py, test_parallel.py,
test_telemetry.py) on tiny local architectures from ``save_tiny_model`` (no downloads), finding a model's parts
through its spec (``spec.decoder_blocks``) rather than Llama's parameter names.
"""

from __future__ import annotations

import math
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.trainer.conftest import MakeRunDir, edit_recipe, metric_steps
from tests.trainer.test_hf_models import ARCHITECTURES, save_tiny_model, use_hf_model
from tests.trainer.test_parallel import FP32_ATOL, launch, max_weight_difference
from tests.trainer.test_precision import build_loop, weights
from tests.trainer.test_resume import start_training, wait_for_step
from trainer.loop import TrainingLoop
from trainer.metrics.sink import read_metric_rows
from trainer.model.hf_model import build_hf_model, load_causal_lm_config, load_pretrained_weights
from trainer.model.spec import HuggingFaceSpec
from trainer.train import main


def hf_loop(tmp_path: Path, make_run_dir: MakeRunDir, model_type: str, **train: object) -> tuple[Path, TrainingLoop]:
    """A run dir continuing a tiny ``model_type`` and the TrainingLoop trainer.train builds for it."""
    run_dir = make_run_dir()
    use_hf_model(run_dir, save_tiny_model(tmp_path / "src", model_type), key="from_pretrained", **train)
    return run_dir, build_loop(run_dir)


def first_block_linear(loop: TrainingLoop) -> nn.Linear:
    """The first ``nn.Linear`` of the first decoder block, found through the spec (no architecture's names)."""
    assert loop.spec is not None
    block = loop.spec.decoder_blocks(loop.accelerator.unwrap_model(loop.model))[0]
    return next(module for module in block.modules() if isinstance(module, nn.Linear))


def record_matmul_dtypes(loop: TrainingLoop) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    first_block_linear(loop).register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    return seen


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_from_pretrained_loads_exactly_what_transformers_loads(tmp_path: Path, model_type: str) -> None:
    """Checkpoint names transformers renames on load (GPT-NeoX's ``embed_out`` is its ``lm_head``) load too."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "src", model_type)
    model = build_hf_model(load_causal_lm_config(folder), seed=1)
    load_pretrained_weights(model, folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(tensor, reference[name]) for name, tensor in model.state_dict().items())


# ---- bf16 / fp16 with dynamic loss scaling ------------------------------------------------------------------


def test_hf_bf16_computes_in_bf16_with_fp32_master_weights_and_optimizer_state(
        tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    _, loop = hf_loop(tmp_path, make_run_dir, "mistral", precision="bf16")
    matmul_dtypes = record_matmul_dtypes(loop)
    before = weights(loop)
    for _ in range(2):
        assert loop.train_step().applied
    assert set(matmul_dtypes) == {torch.bfloat16}
    after = weights(loop)
    assert all(param.dtype == torch.float32 for param in after.values())
    assert any(not torch.equal(before[name], after[name]) for name in after)
    for state in loop.optimizer.state_dict()["state"].values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert loop.precision is not None and loop.precision.scaler is None


def test_hf_fp16_overflow_skips_the_step_halves_the_scale_then_grows_it_back(
        tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    run_dir, loop = hf_loop(tmp_path, make_run_dir, "gpt_neox", precision="fp16", loss_scale_growth_interval=2,
                            max_steps=20, micro_batch_size=2, eval_batches=1)
    assert loop.precision is not None
    matmul_dtypes = record_matmul_dtypes(loop)
    assert loop.train_step().applied
    assert set(matmul_dtypes) == {torch.float16}
    scale = loop.precision.loss_scale
    assert scale == 2.0**16

    overflow = {"inject": True}
    first_block_linear(loop).weight.register_hook(lambda grad: grad * math.inf if overflow["inject"] else grad)
    before, lr_before = weights(loop), loop.optimizer.param_groups[0]["lr"]
    result = loop.train_step()
    assert not result.applied and math.isfinite(result.loss)
    assert all(torch.equal(before[name], param) for name, param in weights(loop).items())  # update skipped
    assert loop.precision.loss_scale == scale / 2
    assert loop.counters.skipped_steps == 1 and loop.counters.nonfinite_in_a_row == 0
    assert loop.optimizer.param_groups[0]["lr"] == lr_before

    loop.checkpointer.save(loop.counters.step)
    resumed = build_loop(run_dir)
    assert resumed.checkpointer.load_latest() == 2
    assert resumed.precision is not None and resumed.precision.loss_scale == scale / 2  # in the checkpoint

    overflow["inject"] = False
    for _ in range(2):  # growth_interval clean steps double the scale again
        assert loop.train_step().applied
    assert loop.precision.loss_scale == scale
    assert not all(torch.equal(before[name], param) for name, param in weights(loop).items())


# ---- torch.compile ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hf_compile_trains_like_eager(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    """``train.compile`` compiles each decoder block of a Llama in place; 2 steps give eager's losses."""
    source = save_tiny_model(tmp_path / "src", "llama", num_hidden_layers=1)
    losses, compiled_blocks = [], []
    for compile_ in (False, True):
        run_dir = make_run_dir(f"compile-{compile_}", train={"micro_batch_size": 2})
        use_hf_model(run_dir, source, key="from_pretrained", compile=compile_)
        loop = build_loop(run_dir)
        assert loop.spec is not None
        blocks = loop.spec.decoder_blocks(loop.accelerator.unwrap_model(loop.model))
        compiled_blocks.append(all(block._compiled_call_impl is not None for block in blocks))
        losses.append([loop.train_step().loss for _ in range(2)])
    assert compiled_blocks == [False, True]
    assert losses[1] == pytest.approx(losses[0], rel=0, abs=1e-4)
    assert losses[0][1] != losses[0][0]  # the second step saw the first update


# ---- kill -9 at a random moment, then a re-run ---------------------------------------------------------------

RESUME_SETTINGS = {"max_steps": 12, "checkpoint_every": 3, "eval_every": 12, "eval_batches": 1, "log_every": 1,
                   "micro_batch_size": 4}


@pytest.mark.slow
def test_hf_sigkill_at_a_random_moment_then_resume_is_bitwise_identical(tmp_path: Path,
                                                                        make_run_dir: MakeRunDir) -> None:
    source = save_tiny_model(tmp_path / "src", "qwen3")
    straight = make_run_dir("straight")
    use_hf_model(straight, source, key="from_pretrained", **RESUME_SETTINGS)
    assert main(["--run-dir", str(straight)]) == 0
    expected = (straight / "model" / "model.safetensors").read_bytes()

    run_dir = make_run_dir("killed")
    use_hf_model(run_dir, source, key="from_pretrained", **RESUME_SETTINGS)
    log = run_dir / "train.log"
    process = start_training(run_dir, log)
    rng = random.Random(1)  # a random step after the first checkpoint, then a random fraction of a step
    wait_for_step(run_dir, rng.randint(RESUME_SETTINGS["checkpoint_every"] + 1, RESUME_SETTINGS["max_steps"] - 4),
                  process)
    time.sleep(rng.uniform(0.0, 0.02))
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not (run_dir / "model" / "model.safetensors").exists()

    resumed = start_training(run_dir, log)
    assert resumed.wait(timeout=300) == 0, log.read_text()[-2000:]
    output = log.read_text()
    resumed_step = int(output.split("Resuming from checkpoint at step ")[1].split()[0])
    assert RESUME_SETTINGS["checkpoint_every"] <= resumed_step < RESUME_SETTINGS["max_steps"]
    assert (run_dir / "model" / "model.safetensors").read_bytes() == expected


# ---- elastic resume: 2 processes -> 1 ------------------------------------------------------------------------

ELASTIC_SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 4, "eval_batches": 1}


@pytest.mark.slow
def test_hf_two_processes_then_one_with_doubled_accumulation_equals_one_straight_through(
        tmp_path: Path, make_run_dir: MakeRunDir, capsys: pytest.CaptureFixture[str]) -> None:
    source = save_tiny_model(tmp_path / "src", "gpt_neox")
    run_dir = make_run_dir("elastic")
    use_hf_model(run_dir, source, key="from_pretrained", **ELASTIC_SETTINGS, num_processes=2)
    launch(run_dir, 2, until_step=2)
    edit_recipe(run_dir, "train", grad_accum_steps=2, num_processes=1)
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 2" in capsys.readouterr().out
    assert metric_steps(run_dir, "train.jsonl")[-1] == ELASTIC_SETTINGS["max_steps"]

    straight = make_run_dir("straight")
    use_hf_model(straight, source, key="from_pretrained", **ELASTIC_SETTINGS, grad_accum_steps=2)
    assert main(["--run-dir", str(straight)]) == 0
    assert max_weight_difference(run_dir, straight) < FP32_ATOL


# ---- MFU from the model's own FLOPs --------------------------------------------------------------------------


def test_hf_flops_per_token_counts_parameters_and_attention_from_the_config(tmp_path: Path) -> None:
    seq_len = 64
    gpt2 = load_causal_lm_config(save_tiny_model(tmp_path / "gpt2", "gpt2", weights=False))
    raw = gpt2.to_dict()  # GPT-2 spells them n_layer / n_head / n_embd
    attention = 12 * raw["n_layer"] * raw["n_head"] * (raw["n_embd"] // raw["n_head"]) * seq_len
    assert HuggingFaceSpec(gpt2, seq_len).flops_per_token(1000) == 6 * 1000 + attention == 6000 + 12 * 2 * 32 * 64

    qwen3 = load_causal_lm_config(save_tiny_model(tmp_path / "qwen3", "qwen3", weights=False, head_dim=16))
    raw = qwen3.to_dict()
    assert raw["head_dim"] != raw["hidden_size"] // raw["num_attention_heads"]
    attention = 12 * raw["num_hidden_layers"] * raw["num_attention_heads"] * raw["head_dim"] * seq_len
    assert HuggingFaceSpec(qwen3, seq_len).flops_per_token(1000) == 6 * 1000 + attention == 6000 + 12 * 2 * 64 * 64


def test_hf_run_logs_mfu_from_the_models_flops(tmp_path: Path, make_run_dir: MakeRunDir) -> None:
    """train.jsonl's model TFLOP/s is tokens/s x (6 N + attention) of the GPT-2, N counting tied weights once."""
    run_dir = make_run_dir(train={"max_steps": 2, "log_every": 1, "eval_every": 2, "eval_batches": 1,
                                  "peak_tflops": 0.5})
    use_hf_model(run_dir, save_tiny_model(tmp_path / "src", "gpt2", weights=False))
    assert main(["--run-dir", str(run_dir)]) == 0
    # By hand from GPT-2's config: tied wte, wpe, per layer 2 LayerNorms + c_attn/c_proj/c_fc/c_proj, final norm.
    vocab, positions, width, layers, heads, seq_len = 512, 128, 32, 2, 4, 64
    per_layer = 2 * 2 * width + (width * 3 * width + 3 * width) + (width * width + width) \
        + (width * 4 * width + 4 * width) + (4 * width * width + width)
    num_params = vocab * width + positions * width + layers * per_layer + 2 * width
    flops = 6 * num_params + 12 * layers * heads * (width // heads) * seq_len
    rows = read_metric_rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["model_tflops_per_s"] * 1e12 == pytest.approx(row["tokens_per_s"] * flops, rel=1e-9)
        assert row["device_peak_tflops"] == 0.5
        assert row["mfu"] == pytest.approx(row["model_tflops_per_s"] / 0.5, rel=1e-9)
