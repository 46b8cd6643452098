"""Model spec: all the trainer knows about a model — build, FLOPs per token, blocks to shard/compile/checkpoint,
the tensor-parallel split, the checkpoint signature and the export — for the built-in Llama and any HF causal LM.

Like torchtitan's ``ModelSpec``: the loop, the parallelism code and the export ask the spec, so nothing outside
``trainer/model/llama.py`` and ``trainer/model/hf_model.py`` knows a model's class or parameter names. Both kinds of
model take ``input_ids`` [batch, seq_len] and give next-token logits (a tensor, or an output with ``.logits``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from core.errors import CheckpointError, ConfigError
from core.rundir import RunPaths
from tokenization.train_tokenizer import check_tokenizer_fits
from trainer.config import ModelConfig, check_tensor_parallel_dims
from trainer.model.export import hf_llama_config
from trainer.model.hf_model import (
    block_class_names,
    build_hf_model,
    check_document_masking,
    decoder_blocks,
    hf_flops_per_token,
    load_causal_lm_config,
    load_pretrained_weights,
    text_config,
    tied_names,
)
from trainer.model.llama import ModelShape, build_model, flops_per_token


class ModelSpec(Protocol):
    """What the trainer needs of a model; see :class:`BuiltinSpec` and :class:`HuggingFaceSpec`."""

    def build(self, seed: int) -> nn.Module:
        """The model to train, in fp32 on the CPU: seeded random weights, or the pretrained ones."""

    def block_class_names(self) -> list[str]:
        """Class names of one decoder block: FSDP's shard unit."""

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder blocks of ``model``, in order: what ``torch.compile`` and tensor parallelism act on."""

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        """Recompute each block's activations in backward."""

    def tensor_parallel_plan(self, tensor_parallel_size: int) -> dict[str, ParallelStyle]:
        """The split of one block (names relative to it); ConfigError naming train.tensor_parallel_size if none."""

    def flops_per_token(self, num_params: int) -> float:
        """Training FLOPs per token (for MFU)."""

    def check_document_masking(self, model: nn.Module) -> None:
        """ConfigError naming train.document_masking unless ``model`` attends within documents given position_ids."""

    def signature(self) -> dict[str, Any]:
        """What a checkpoint records of the model, so it never resumes into another one."""

    def export_config(self) -> dict[str, Any]:
        """``config.json`` of the export, in the model's own architecture."""

    def export_weights(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole state dict of ``model`` as the export's safetensors hold it (the architecture's own names)."""


@dataclass(frozen=True)
class BuiltinSpec:
    """tokenmill's Llama-style decoder (``trainer/model/llama.py``): the default and the fast path."""

    shape: ModelShape
    eos_id: int = 0
    pad_id: int = 1

    def build(self, seed: int) -> nn.Module:
        return build_model(self.shape, seed)

    def block_class_names(self) -> list[str]:
        return ["LlamaDecoderLayer"]

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        model.model.activation_checkpointing = True

    def tensor_parallel_plan(self, tensor_parallel_size: int) -> dict[str, ParallelStyle]:
        """Megatron's split: q/k/v and gate/up by output rows, o/down by input columns (one all-reduce each)."""
        try:
            check_tensor_parallel_dims(self.shape.dims, tensor_parallel_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}

    def flops_per_token(self, num_params: int) -> float:
        return flops_per_token(self.shape, num_params)

    def check_document_masking(self, model: nn.Module) -> None:
        """The built-in model always does (``trainer/model/llama.py``; tests/trainer/test_document_mask.py)."""

    def signature(self) -> dict[str, Any]:
        return {"dims": self.shape.dims.model_dump(), "vocab_size": self.shape.vocab_size,
                "max_seq_len": self.shape.max_seq_len}

    def export_config(self) -> dict[str, Any]:
        return hf_llama_config(self.shape, self.eos_id, self.pad_id)

    def export_weights(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state_dict  # already HF Llama's names; a tied built-in model has no lm_head parameter at all


TENSOR_PARALLEL_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
"""The entries of a transformers ``base_model_tp_plan`` inside a decoder block that tokenmill applies."""


@dataclass(frozen=True)
class HuggingFaceSpec:
    """A ``transformers`` causal LM: built from ``config`` (seeded), or loaded from ``weights_dir``'s safetensors."""

    config: Any
    seq_len: int
    weights_dir: Path | None = None

    def build(self, seed: int) -> nn.Module:
        model = build_hf_model(self.config, seed)
        if self.weights_dir is not None:
            load_pretrained_weights(model, self.weights_dir)
        return model

    def block_class_names(self) -> list[str]:
        return block_class_names(_class_of(self.config))

    def decoder_blocks(self, model: nn.Module) -> list[nn.Module]:
        return decoder_blocks(model)

    def enable_activation_checkpointing(self, model: nn.Module) -> None:
        # Non-reentrant: works with DDP/FSDP hooks and with inputs that need no grad (as the built-in model).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def tensor_parallel_plan(self, tensor_parallel_size: int) -> dict[str, ParallelStyle]:
        """The block entries of the model's own ``base_model_tp_plan`` (``layers.*.<name>``: colwise/rowwise)."""
        text = text_config(self.config)
        plan = getattr(text, "base_model_tp_plan", None) or {}
        block_plan = {key.split(".*.", 1)[1]: style for key, style in plan.items() if ".*." in key}
        unsupported = sorted({style for style in block_plan.values() if style not in TENSOR_PARALLEL_STYLES})
        if not block_plan or unsupported:
            why = f"its tp_plan uses {unsupported}" if unsupported else "transformers defines no tp_plan for it"
            raise ConfigError(f"train.tensor_parallel_size {tensor_parallel_size}: model_type "
                              f"'{self.config.model_type}' cannot be split by tensor parallelism ({why}); set "
                              "train.tensor_parallel_size: 1 (use train.fsdp to shard it instead).")
        heads = {"num_attention_heads": text.num_attention_heads,
                 "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                 "intermediate_size": getattr(text, "intermediate_size", None) or 4 * text.hidden_size}
        for name, size in heads.items():
            if size % tensor_parallel_size:
                raise ConfigError(f"train.tensor_parallel_size {tensor_parallel_size} must divide the model's "
                                  f"{name} ({size}); choose a divisor of it.")
        return {name: TENSOR_PARALLEL_STYLES[style]() for name, style in block_plan.items()}

    def flops_per_token(self, num_params: int) -> float:
        return hf_flops_per_token(self.config, num_params, self.seq_len)

    def check_document_masking(self, model: nn.Module) -> None:
        check_document_masking(model)

    def signature(self) -> dict[str, Any]:
        config = self.config.to_diff_dict()
        config.pop("transformers_version", None)
        config.pop("use_cache", None)
        return {"hf_config": config, "max_seq_len": self.seq_len}

    def export_config(self) -> dict[str, Any]:
        config = copy.deepcopy(self.config)
        config.use_cache = True  # set off for training only; inference wants it
        return config.to_dict()

    def export_weights(self, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tied weights left out and transformers' load-time renamings reverted, as ``save_pretrained`` writes them
        (a GPT-NeoX export holds ``embed_out.weight``, not the in-memory ``lm_head.weight``)."""
        from transformers.core_model_loading import revert_weight_conversion  # transformers: ~5 s, HF models only

        tied = tied_names(model)
        return revert_weight_conversion(model, {name: t for name, t in state_dict.items() if name not in tied})


def _class_of(config: Any) -> type:
    from transformers import AutoModelForCausalLM  # transformers: ~5 s, HF models only

    return AutoModelForCausalLM._model_mapping[type(config)]


def model_spec(model: ModelConfig, paths: RunPaths, vocab_size: int, seq_len: int,
               eos_id: int = 0, pad_id: int = 1, initial_weights: bool = True) -> ModelSpec:
    """The spec of the recipe's model: the built-in one, or the HF model the model stage put in ``base_model/``.

    ``vocab_size``: ids the shards use. ``initial_weights``: load ``from_pretrained``'s weights (False when a
    checkpoint will replace them). Raises ConfigError when the ids do not fit a HF model's embedding, and
    CheckpointError when ``base_model/`` is missing (the model stage has not run).
    """
    if not model.is_hugging_face:
        return BuiltinSpec(ModelShape(model.resolved_dims(), vocab_size, seq_len), eos_id, pad_id)
    if not paths.base_model.is_dir():
        raise CheckpointError(f"{paths.base_model}: missing; the recipe's model.{_source_key(model)} is copied "
                              "there by `tokenmill prepare`: run it first.")
    config = load_causal_lm_config(paths.base_model, model.trust_remote_code)
    check_tokenizer_fits(vocab_size, text_config(config).vocab_size, f"{paths.shard_index} vs {paths.base_model}")
    pretrained = model.from_pretrained is not None and initial_weights
    return HuggingFaceSpec(config, seq_len, paths.base_model if pretrained else None)


def _source_key(model: ModelConfig) -> str:
    return "from_pretrained" if model.from_pretrained is not None else "hf_config"


def output_logits(output: Any) -> torch.Tensor:
    """Logits from a model's forward: the tensor itself (built-in) or ``output.logits`` (transformers)."""
    return output if isinstance(output, torch.Tensor) else output.logits
