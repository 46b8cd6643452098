"""Export: trained weights -> ``model/`` in Hugging Face format (config.json, model.safetensors, tokenizer files).

The model's spec gives ``config.json`` in the model's own architecture (the built-in model's parameter names
already are HF Llama's; a Hugging Face model keeps its ``model_type``), so the weights file is a plain
``save_file`` of the state dict and ``transformers.AutoModelForCausalLM.from_pretrained(model_dir)`` loads it
with no missing or unexpected keys. The folder is built under a temporary name and swapped in whole.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from core.files.atomic import TEMP_PREFIX, out_of_space, read_json
from core.layout import CHAT_TEMPLATE_FILE as CHAT_TEMPLATE_FILE  # re-exported: trainer.train
from core.layout import HF_CONFIG_FILE, TOKENIZER_FILE
from core.rundir import RunPaths
from tokenization.special_tokens import load_tokenizer, model_special_tokens
from tokenization.train_tokenizer import EOS_TOKEN, PAD_TOKEN
from trainer.checkpoint.layout import EXPORT_STATE_NAME, exported_step  # noqa: F401 (its old home)
from trainer.loader.batches import EOS_ID, PAD_ID
from trainer.model.llama import INIT_STD, ModelShape

"""Where a model folder keeps its chat template (transformers >= 4.43 saves it there, and reads it first)."""


def hf_llama_config(shape: ModelShape, eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> dict[str, Any]:
    """A ``LlamaConfig``-compatible dict; RoPE is given both ways (v5 ``rope_parameters`` and legacy ``rope_theta``).

    ``eos_id``/``pad_id``: the tokenizer's (a tokenizer tokenmill trained has 0 and 1).
    """
    dims = shape.dims
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": shape.vocab_size, "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size, "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads, "num_key_value_heads": dims.num_kv_heads,
        "head_dim": shape.head_dim, "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": dims.rms_norm_eps, "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": INIT_STD, "tie_word_embeddings": dims.tie_word_embeddings,
        # No BOS token exists: documents are separated by EOS, so a sequence starts after one (GPT-2 style).
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` so ``AutoTokenizer.from_pretrained(model_dir)`` finds the special tokens."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN}


def model_tokenizer_config(folder: Path) -> dict[str, Any]:
    """A model's own ``tokenizer_config.json`` (copied into ``folder``, the export) with the EOS and pad tokens
    tokenmill trained with filled in where it names none: a tokenizer without a pad token was padded with EOS.

    The ids are read as the tokenizer stage read them (:func:`tokenization.special_tokens.model_special_tokens`),
    so ``AutoTokenizer.from_pretrained(model_dir)`` knows both; the model's other settings are kept.
    """
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
    special = model_special_tokens(folder, tokenizer)
    own = read_json(folder / "tokenizer_config.json")
    for key, token_id in (("eos_token", special.eos_id), ("pad_token", special.pad_id)):
        if own.get(key) is None:
            own[key] = tokenizer.id_to_token(token_id)
    return own


def export_model(state_dict: dict[str, torch.Tensor], config: dict[str, Any], paths: RunPaths,
                 tokenizer_json: Path | None = None, training_state: dict[str, Any] | None = None,
                 tokenizer_extras: Sequence[Path] = (), target: Path | None = None,
                 chat_template: str | None = None) -> Path:
    """Write the run's ``model/`` (or ``target``, a folder in the run dir) atomically, replacing an older export,
    from an unwrapped model's state dict.

    ``config``: the ``config.json`` content (:meth:`trainer.model.spec.ModelSpec.export_config`). Weights are
    saved as contiguous fp32 CPU tensors; the tokenizer files are written as :func:`write_tokenizer_files` says.
    The state dict must hold whole tensors, and no two names may share one (leave tied weights out): gather a
    tensor-parallel model's slices first (:func:`trainer.parallel.accelerator.full_state_dict`, on every rank); a
    DTensor raises TypeError. Returns the folder.
    """
    split = [name for name, tensor in state_dict.items() if isinstance(tensor, DTensor)]
    if split:
        raise TypeError(f"export_model got tensor-parallel slices ({split[0]}, ...); pass "
                        "trainer.parallel.accelerator.full_state_dict(accelerator, model), called on every rank")

    def write_weights(staging: Path) -> None:
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state_dict.items()}
        with paths.atomic_write(staging / "model.safetensors") as tmp:
            save_file(tensors, tmp, metadata={"format": "pt"})
        paths.write_json(staging / HF_CONFIG_FILE, config)

    files = ExportFiles(tokenizer_json, tuple(tokenizer_extras), training_state or {}, chat_template)
    return write_export(paths, paths.model if target is None else target, write_weights, files,
                        4 * sum(t.numel() for t in state_dict.values()))


@dataclass(frozen=True)
class ExportFiles:
    """What an export holds besides its weights: the tokenizer, its settings and template, the training state."""

    tokenizer_json: Path | None = None
    tokenizer_extras: tuple[Path, ...] = ()
    """A model's own ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``."""
    training_state: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    """The chat template the run's conversations were rendered with (replaces any template of the extras)."""


def write_export(paths: RunPaths, model_dir: Path, write_weights: Callable[[Path], None], files: ExportFiles,
                 num_bytes: int) -> Path:
    """Build the export folder under a temporary name (``write_weights(folder)``, then ``files``) and swap it in.

    ``num_bytes``: about what the weights take, for the message when the disk is full.
    """
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{model_dir.name}.", dir=model_dir.parent))
    try:
        write_weights(staging)
        if files.tokenizer_json is not None and Path(files.tokenizer_json).is_file():
            write_tokenizer_files(paths, staging, files)
        paths.write_json(staging / EXPORT_STATE_NAME, files.training_state)
        paths.replace_folder(staging, model_dir)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if (no_space := out_of_space(err, model_dir, num_bytes)) is not None:
            raise no_space from err
        raise
    return model_dir


def write_tokenizer_files(paths: RunPaths, staging: Path, files: ExportFiles) -> None:
    """Copy the tokenizer with the extras beside it, their EOS and pad filled in (:func:`model_tokenizer_config`),
    else a tokenizer_config.json for a tokenmill-trained tokenizer; then the chat template, if any, as
    ``chat_template.jinja`` (the one place transformers >= 4.43 reads it from first; no second copy stays in
    tokenizer_config.json, so ``apply_chat_template`` on the export renders what training rendered)."""
    assert files.tokenizer_json is not None
    copies = [(TOKENIZER_FILE, files.tokenizer_json)] + [(Path(extra).name, extra) for extra in files.tokenizer_extras]
    for name, source in copies:
        with paths.atomic_write(staging / name) as tmp:
            shutil.copyfile(source, tmp)
    own = staging / "tokenizer_config.json"
    settings = model_tokenizer_config(staging) if own.is_file() else tokenizer_config()
    if files.chat_template is not None:
        settings.pop("chat_template", None)
        paths.write_text(staging / CHAT_TEMPLATE_FILE, files.chat_template)
    paths.write_json(own, settings)
