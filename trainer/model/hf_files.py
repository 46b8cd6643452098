"""The files of a Hugging Face model folder: its config.json and safetensors weights, found and checked to exist.

Torch-free (:mod:`trainer.model.hf_model` reads them with torch): the base-model stage lists its inputs with these, and
``tokenmill status`` imports every stage without importing torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import ConfigError
from core.layout import CHAT_TEMPLATE_FILE as CHAT_TEMPLATE_FILE  # re-exported: where transformers reads it
from core.layout import HF_CONFIG_FILE as CONFIG_NAME

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that only ``torch.load`` (pickle) reads; tokenmill never unpickles what it is given."""


def config_file(path: Path) -> Path:
    """``path`` itself when it is a file, else ``path/config.json``; ConfigError when there is none."""
    path = Path(path)
    found = path if path.is_file() else path / CONFIG_NAME
    if not found.is_file():
        where = "does not exist" if not path.exists() else f"holds no {CONFIG_NAME}"
        raise ConfigError(f"{path}: {where}; point model.hf_config / model.from_pretrained at a Hugging Face model "
                          f"folder (with {CONFIG_NAME}) or at a {CONFIG_NAME} file.")
    return found


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (one file, or the shards its index names), each checked to exist.

    Raises ConfigError for a folder with only pickled weights (saying how to convert), with no weights, or an
    index naming a missing shard.
    """
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{index}: not a safetensors index (a JSON object with \"weight_map\"): {err}; "
                              "re-save the model with `save_pretrained`.") from None
        missing = [name for name in names if not (folder / name).is_file() or Path(name).name != name]
        if missing:
            raise ConfigError(f"{index} names {len(missing)} shard(s) not in {folder} ({missing[0]}, …); copy the "
                              "whole model folder again.")
        return [folder / name for name in names]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    pickled = sorted(path.name for path in folder.iterdir() if path.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(f"{folder}: weights only as pickle ({pickled[0]}); tokenmill loads safetensors only, "
                          "never unpickles. Convert once where you trust the file: `AutoModelForCausalLM."
                          "from_pretrained(folder).save_pretrained(folder)` writes model.safetensors.")
    raise ConfigError(f"{folder}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; model.from_pretrained needs the "
                      "weights (use model.hf_config to start from random weights).")


def has_chat_template(model_dir: Path) -> bool:
    """Whether the model folder carries a chat template where transformers looks for one (``chat_template.jinja``,
    else ``chat_template`` in ``tokenizer_config.json``)."""
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        return True
    try:
        config = json.loads((model_dir / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def require_chat_template(model_dir: Path) -> Path:
    """``model_dir`` when it has a chat template to chat with; ConfigError naming it and the fix otherwise (torch-free:
    ``tokenmill generate --chat`` says so before loading anything)."""
    if not has_chat_template(model_dir):
        raise ConfigError(f"{model_dir}: the model has no chat template ({CHAT_TEMPLATE_FILE} or 'chat_template' in "
                          f"{TOKENIZER_CONFIG_FILE}) to chat with; fine-tune it on conversations (train.mode: sft, "
                          "docs/sft.md), whose export carries the template, or leave out --chat to continue text")
    return model_dir
