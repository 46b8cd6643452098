"""Hugging Face models: a local config or model folder -> a ``transformers`` causal LM to train (never a download).

``model.hf_config`` builds any architecture ``AutoModelForCausalLM.from_config`` knows, with weights drawn from
``train.seed``; ``model.from_pretrained`` loads a local folder's safetensors for continued pretraining. The
folder is checked before anything is built, so a wrong one fails with one line naming the file or key: no
``config.json``, a config that is not a causal LM, remote code without ``model.trust_remote_code``, pickled
weights (``*.bin``, ``*.pt``: never unpickled), a missing or corrupt shard, weights that do not fit the config.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from core.errors import ConfigError
from trainer.model.hf_files import (  # noqa: F401  (re-exported: the file names of a model folder)
    CONFIG_NAME,
    PICKLE_SUFFIXES,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    config_file,
    weight_files,
)


def read_config_dict(path: Path) -> dict[str, Any]:
    """The JSON mapping of a ``config.json``; ConfigError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); fix or replace the model's config.json.") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{path}: a Hugging Face config.json must be a JSON object with a \"model_type\" "
                          "string; save it with `config.save_pretrained(folder)`.")
    return data


def load_causal_lm_config(path: Path, trust_remote_code: bool = False) -> Any:
    """The ``transformers`` config of a causal LM at ``path`` (a folder or a config.json); ConfigError otherwise."""
    from transformers import AutoConfig  # transformers: ~5 s, HF models only
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # transformers: ~5 s, HF models only

    file = config_file(path)
    refuse_model_code(file, trust_remote_code)
    data = read_config_dict(file)
    model_type = data["model_type"]
    if "auto_map" in data:
        config = AutoConfig.from_pretrained(file.parent, trust_remote_code=True, local_files_only=True)
    elif model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{file}: model_type '{model_type}' is not an architecture this transformers knows; "
                          "upgrade transformers or use a supported model.")
    else:
        config = CONFIG_MAPPING[model_type].from_dict(data)
    check_causal_lm(config, file)
    return config


def refuse_model_code(file: Path, trust_remote_code: bool) -> None:
    """ConfigError naming ``file`` (a config.json) when its ``auto_map`` names Python files of the model folder
    and ``trust_remote_code`` (the decision of the command, from the recipe the user passed) is off."""
    data = read_config_dict(file)
    kind = data["model_type"]
    if "auto_map" in data and not trust_remote_code:
        raise ConfigError(f"{file}: auto_map: model_type '{kind}' is defined by Python files in the model folder, "
                          "which tokenmill runs only when the recipe you pass sets model.trust_remote_code: true "
                          "(read that code first; a run dir's run.yaml never counts).")


def check_causal_lm(config: Any, file: Path) -> None:
    """ConfigError naming ``model_type`` unless ``AutoModelForCausalLM`` builds a decoder from this config.

    Encoders that also have a causal-LM head (BERT, RoBERTa, …) count only with ``is_decoder: true``.
    """
    from transformers.models.auto.modeling_auto import (  # transformers: ~5 s, HF models only
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = getattr(config, "architectures", None) or []
    remote = bool(getattr(config, "auto_map", None))
    is_encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    not_causal = (not remote and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) or is_encoder or (
        architectures and not remote and not causal_classes.intersection(architectures))
    if not_causal or getattr(config, "is_encoder_decoder", False):
        named = f" ({', '.join(architectures)})" if architectures else ""
        raise ConfigError(f"{file}: model_type '{model_type}'{named} is not a causal (decoder-only) language model; "
                          "tokenmill trains next-token prediction: use a causal-LM config (Llama, Qwen, Mistral, "
                          "GPT-NeoX, GPT-2, …).")


def read_weights(files: list[Path], headers_only: bool = False) -> dict[str, torch.Tensor | None]:
    """Every tensor of the safetensors ``files`` (``headers_only``: names only, values None, nothing loaded);
    ConfigError naming a corrupt or duplicated file."""
    tensors: dict[str, torch.Tensor | None] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in tensors:
                        raise ConfigError(f"{file}: tensor {name} is also in another shard; re-save the model.")
                    tensors[name] = None if headers_only else handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(f"{file}: not a readable safetensors file ({err}); copy it again or re-save the "
                              "model with `save_pretrained`.") from None
    return tensors


def build_hf_model(config: Any, seed: int) -> nn.Module:
    """A freshly initialised causal LM in fp32; the same seed gives the same weights (init is seeded locally)."""
    from transformers import AutoModelForCausalLM  # transformers: ~5 s, HF models only

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False  # training: no key/value cache in the outputs
    return model


PROBE_DOCUMENT_LENGTHS = (3, 5)
"""Two documents packed into one probe row: the second's logits must not see the first."""


def check_document_masking(model: nn.Module) -> None:
    """ConfigError naming ``train.document_masking`` unless ``model`` keeps packed documents apart.

    transformers builds a packed-sequence mask from ``position_ids`` that restart at 0 (``create_causal_mask``);
    an architecture that does not (no ``position_ids`` argument, a mask of its own) would attend across documents
    without a word. So one probe row is run: the second document's logits must equal its logits alone. Runs in
    eval mode (no dropout) with the RNG state restored, so training is unchanged by it.
    """
    vocab_size = text_config(model.config).vocab_size
    ids = torch.arange(sum(PROBE_DOCUMENT_LENGTHS), dtype=torch.int64)[None] % vocab_size
    positions = torch.cat([torch.arange(length) for length in PROBE_DOCUMENT_LENGTHS])[None]
    first_length = PROBE_DOCUMENT_LENGTHS[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            packed = model(input_ids=ids, position_ids=positions).logits[0, first_length:]
            alone = model(input_ids=ids[:, first_length:]).logits[0]
        kept_apart = torch.allclose(packed, alone, rtol=1e-4, atol=1e-4)
    except TypeError:  # its forward takes no position_ids
        kept_apart = False
    finally:
        model.train(was_training)
    if not kept_apart:
        raise ConfigError(f"train.document_masking: model_type '{model.config.model_type}' does not keep packed "
                          "documents apart (its attention ignores packed position_ids); set "
                          "train.document_masking: false for this model (docs/training.md lists the covered ones).")


def load_pretrained_weights(model: nn.Module, folder: Path) -> None:
    """Copy a model folder's safetensors into ``model``; ConfigError when a name or shape does not fit the config.

    Tied output weights (``tie_word_embeddings``) may be absent from the files, as ``save_pretrained`` leaves them.
    """
    to_model_name = checkpoint_renaming(model)
    expected = model.state_dict()
    saved = {_own_name(model, expected, to_model_name(name)): tensor
             for name, tensor in read_weights(weight_files(folder)).items()}
    tied = tied_names(model)
    missing = sorted(set(expected) - set(saved) - tied)
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise ConfigError(f"{folder}: the weights do not match config.json ({detail}, {len(missing)} missing, "
                          f"{len(unexpected)} unexpected); use the config the weights were saved with.")
    for name, tensor in saved.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(f"{folder}: {name} has shape {tuple(tensor.shape)} in the weights, the config builds "
                              f"{tuple(expected[name].shape)}; use the config the weights were saved with.")
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            if name in saved:
                param.copy_(saved[name].to(param.dtype))
    if tied:
        model.tie_weights()


def checkpoint_renaming(model: nn.Module) -> Callable[[str], str]:
    """Checkpoint name -> the model's state-dict name, by transformers' own renamings for this architecture.

    transformers 5 renames some checkpoint keys on load, and ``save_pretrained`` writes the original ones back
    (GPT-NeoX/Pythia: ``embed_out.weight`` in the files is the model's ``lm_head.weight``). Only renamings
    apply: a checkpoint that needs a tensor conversion (fused experts, …) fails the name check below.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping  # transformers: ~5 s, HF models only
    from transformers.core_model_loading import WeightConverter, rename_source_key  # transformers: ~5 s, HF models only

    renamings = [t for t in get_model_conversion_mapping(model) if not isinstance(t, WeightConverter)]
    return lambda name: rename_source_key(name, renamings, [])[0]


def _own_name(model: nn.Module, expected: dict[str, torch.Tensor], name: str) -> str:
    """A checkpoint name in the model's own spelling: base-model checkpoints lack the ``model.`` style prefix."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not name.startswith(f"{prefix}.") and f"{prefix}.{name}" in expected:
        return f"{prefix}.{name}"
    return name


def tied_names(model: nn.Module) -> set[str]:
    """Parameter names that are another name's very Parameter (a tied ``lm_head.weight``).

    By identity, not storage address: under FSDP2 every parameter is a DTensor whose local shard may be empty.
    """
    first_name: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            tied.add(name)
        first_name.setdefault(id(param), name)
    return tied


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules whose class the model names in ``_no_split_modules``."""
    names = block_class_names(model)
    return [module for module in model.modules() if type(module).__name__ in names]


def block_class_names(model: nn.Module) -> list[str]:
    """``_no_split_modules``: the classes transformers itself keeps whole when it shards (one decoder block)."""
    names = sorted(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError(f"{type(model).__name__} names no decoder block class (_no_split_modules); tokenmill "
                          "cannot shard, compile or checkpoint it per block: set train.fsdp, train.compile and "
                          "train.activation_checkpointing to false.")
    return names


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it; a text-only config is its own)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def hf_flops_per_token(config: Any, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 * params plus attention's 12 * layers * (heads * head_dim) * seq_len.

    The attention width is read from the config (``head_dim`` when given: Qwen3 and Gemma differ from
    hidden_size / heads), as PaLM's appendix B counts it.
    """
    text = text_config(config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 6.0 * num_params + 12.0 * text.num_hidden_layers * heads * head_dim * seq_len
