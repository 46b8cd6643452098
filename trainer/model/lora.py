"""LoRA: a Hugging Face causal LM -> the same model with ``peft`` low-rank adapters (only they train) -> its export.

The adapted model is a ``peft.PeftModel``; the trainer treats it as any model. Its state dict (frozen base weights
and adapters) is what a checkpoint saves, with the AdamW state of the adapters, so a resume is the same as full
training's. The export is merged by default: each adapted layer's weight becomes ``W + scale * B @ A`` (peft's own
``get_delta_weight``, the sum ``merge_and_unload`` computes) under the base model's names, so plain ``transformers``
loads it; or the adapter alone, as ``PeftModel.save_pretrained`` writes it, to load on the base model with
``PeftModel.from_pretrained``. peft is imported here only (with transformers, seconds): the built-in path never pays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.errors import ConfigError
from trainer.config import LoraConfig

ADAPTER_NAME = "default"
"""peft's name for the one adapter a model gets."""


def apply_lora(model: nn.Module, lora: LoraConfig, seed: int) -> nn.Module:
    """``model`` with adapters on ``lora.target_modules``, its other weights frozen; the adapters' initial weights
    come from ``seed`` (A random, B zero: the adapted model starts as the base model).

    Raises ConfigError naming ``train.lora`` when ``model`` is not a Hugging Face model or no layer matches.
    """
    from peft import LoraConfig as PeftLoraConfig  # peft imports transformers: ~5 s, LoRA runs only
    from peft import get_peft_model
    from transformers import PreTrainedModel  # transformers: ~5 s, HF models only

    if not isinstance(model, PreTrainedModel):
        raise ConfigError("train.lora adapts a Hugging Face model, and the recipe trains tokenmill's built-in model; "
                          "set model.from_pretrained to a model folder (an export such as runs/tiny/model is one), or "
                          "remove train.lora for full training.")
    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                            target_modules=lora.target_modules, task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    except ValueError as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"train.lora.target_modules {lora.target_modules!r}: {reason}; name linear layers of the "
                          "model (e.g. [q_proj, v_proj]) or use all-linear.") from None


def is_lora_model(model: nn.Module) -> bool:
    """True for a model :func:`apply_lora` adapted (checked without importing peft for other models)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def lora_signature(lora: LoraConfig) -> dict[str, Any]:
    """What a checkpoint records of the adapters (a checkpoint resumes only into the same ones)."""
    return lora.model_dump(mode="json", exclude={"export"})


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict, in its own names, with every adapted weight replaced by ``W + delta``.

    Computed beside the model (it is not changed: merging in place and back would not restore W bit for bit).
    """
    from peft.tuners.lora import LoraLayer  # peft: LoRA runs only

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                weight = module.get_base_layer().weight
                merged[f"{name}.weight"] = weight.detach() + module.get_delta_weight(ADAPTER_NAME).to(weight.dtype)
    state: dict[str, torch.Tensor] = {}
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        state[name] = merged.get(name, tensor)
    return state


def save_adapter(model: nn.Module, folder: Path) -> None:
    """Write the adapter as peft saves it (``adapter_config.json``, ``adapter_model.safetensors``) into ``folder``."""
    model.save_pretrained(str(folder), safe_serialization=True)
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model card template, not tokenmill's
