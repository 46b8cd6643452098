"""``train.lora``: only the adapters train, they and their AdamW state are in every checkpoint, the export is merged
(plain transformers, the logits of base + adapters) or a peft adapter dir, 2 processes resume on 1, and the
combinations that do not work say so in one line. Resume after kill -9 with adapters (dropout on) is bitwise exact:
tests/trainer/test_dpo_guarantees.py, which trains LoRA adapters by DPO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from core.errors import CheckpointError
from core.rundir import RunPaths
from tests.trainer.chat_run import make_chat_run_dir
from tests.trainer.conftest import Corpus, edit_recipe, metric_steps
from tests.trainer.test_parallel import FP32_ATOL, launch, max_weight_difference
from tests.trainer.test_precision import build_loop
from trainer.config import TrainConfig
from trainer.loader.batches import PAD_ID, SplitRows, load_batch
from trainer.train import export_if_stale, export_if_stale_to, main

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
"""A chat template over the test tokenizer's own tokens (the run's, as the chat data stage would record it)."""
MESSAGES = [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "return 1"}]


def val_batch(run_dir: Path) -> dict[str, torch.Tensor]:
    rows = SplitRows(run_dir, "val", PAD_ID, mode="sft")
    return load_batch(rows, torch.arange(4).numpy(), document_masking=True).model_kwargs(torch.device("cpu"))


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def test_lora_trains_only_the_adapters_and_exports_a_merged_model_with_the_runs_template(
        tmp_path: Path, stdlib_corpus: Corpus) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, max_steps=3, checkpoint_every=3, eval_every=3, lr=1e-2,
                                lora=LORA)
    (run_dir / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    assert main(["--run-dir", str(run_dir)]) == 0
    checkpoint = run_dir / "checkpoints" / "step-0000003"
    saved = load_file(checkpoint / "model.safetensors")
    base = load_file(run_dir / "base_model" / "model.safetensors")
    adapters = sorted(name for name in saved if ".lora_" in name)
    assert len(adapters) == 2 * 2 * 2  # A and B of q_proj and v_proj in 2 layers
    assert all(saved[name].abs().sum() > 0 for name in adapters if "lora_B" in name)  # B starts at 0: trained
    for name, tensor in saved.items():  # every base weight as it was
        if ".lora_" not in name:
            own = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(tensor, base[own]), name
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == len(adapters)  # AdamW moments of the adapters only

    merged, info = AutoModelForCausalLM.from_pretrained(run_dir / "model", output_loading_info=True,
                                                        dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(run_dir / "base_model", dtype=torch.float32),
                             LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "v_proj"]))
    adapted.load_state_dict(saved, strict=True)
    batch = val_batch(run_dir)
    torch.testing.assert_close(logits(merged, batch), logits(adapted, batch), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(merged, batch), logits(adapted.get_base_model(), batch))

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == \
        "user: def f():<|endoftext|>assistant: return 1<|endoftext|>"


def test_lora_adapter_export_loads_with_peft_on_the_base_model(tmp_path: Path, stdlib_corpus: Corpus) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, lr=1e-2, lora={**LORA, "export": "adapter"})
    loop = build_loop(run_dir)
    loop.run(2)
    paths = RunPaths(run_dir)
    export_if_stale(loop, paths)
    export_if_stale_to(loop, paths, run_dir / "merged")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= \
        {path.name for path in (run_dir / "model").iterdir()}
    assert not (run_dir / "model" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(run_dir / "base_model", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, run_dir / "model")
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged", dtype=torch.float32)
    batch = val_batch(run_dir)
    torch.testing.assert_close(logits(adapted, batch), logits(merged, batch), rtol=1e-5, atol=1e-5)

    edit_recipe(run_dir, "train", lora={**LORA, "r": 8})  # other adapters: the checkpoint does not resume into them
    with pytest.raises(CheckpointError, match=r"the checkpoint's model .* differs from the recipe's"):
        build_loop(run_dir).checkpointer.load_latest()


def test_lora_with_a_sharding_engine_or_the_builtin_model_is_refused_in_one_line(
        tmp_path: Path, stdlib_corpus: Corpus, capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in (("fsdp", True), ("tensor_parallel_size", 2), ("deepspeed_config", "ds.json")):
        with pytest.raises(ValidationError, match=f"train.lora cannot be combined with train.{key}"):
            TrainConfig(lora=LORA, num_processes=2, **{key: value})
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, model_type=None, lora=LORA)
    assert main(["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: train.lora adapts a Hugging Face model")


ELASTIC_SETTINGS = {"max_steps": 4, "checkpoint_every": 2, "eval_every": 4, "eval_batches": 1, "lr": 1e-2,
                    "lora": LORA}


@pytest.mark.slow
def test_lora_sft_on_two_processes_then_one_equals_one_straight_through(
        tmp_path: Path, stdlib_corpus: Corpus, capsys: pytest.CaptureFixture[str]) -> None:
    """Also the SFT loss across ranks: each rank's micro-batches hold other numbers of trained tokens, and the step
    is the mean over all of them (a mean of the ranks' means would differ from 1 process)."""
    run_dir = make_chat_run_dir(tmp_path, stdlib_corpus, "elastic", **ELASTIC_SETTINGS, num_processes=2)
    launch(run_dir, 2, until_step=2)
    edit_recipe(run_dir, "train", grad_accum_steps=2, num_processes=1)
    capsys.readouterr()
    assert main(["--run-dir", str(run_dir)]) == 0
    assert "Resuming from checkpoint at step 2" in capsys.readouterr().out
    assert metric_steps(run_dir, "train.jsonl")[-1] == ELASTIC_SETTINGS["max_steps"]

    straight = make_chat_run_dir(tmp_path, stdlib_corpus, "straight", **ELASTIC_SETTINGS, grad_accum_steps=2)
    assert main(["--run-dir", str(straight)]) == 0
    assert max_weight_difference(run_dir, straight) < FP32_ATOL
