"""What a run's ``train.mode`` means for its evaluation: which tokens a loss is over, and what scores a pair.

An SFT run's validation loss is the loss of the tokens whose ``loss_mask`` is 1 (:mod:`core.shards.chat`): the
assistant's replies with their end-of-turn token under ``chat.loss: assistant`` (:func:`scored_tokens` labels it).
Scored over every token, the number would mostly measure how well the model predicts the user's questions and the
template's headers, which it is not trained to do. A DPO run's checkpoints are scored on pairs, with the
``train.dpo`` settings of :func:`dpo_settings`. The mode is the recipe's ``train.mode`` (:func:`train_mode`).
"""

from __future__ import annotations

from typing import Any

from core.eval_results import SCORED_TOKENS

SFT_MODE = "sft"
DPO_MODE = "dpo"
DPO_DEFAULTS: dict[str, Any] = {"beta": 0.1, "label_smoothing": 0.0, "loss": "sigmoid", "simpo_gamma": 0.5}
"""``train.dpo``'s settings that score a pair, with the values a recipe gets when it leaves them out."""


def train_mode(train: Any) -> str:
    """``train.mode`` of a TrainConfig: ``pretrain``, ``sft`` or ``dpo``; ``pretrain`` for a config without the key
    (read with a default so evaluation works with every TrainConfig, those written before SFT included)."""
    return str(getattr(train, "mode", "pretrain"))


def is_sft(train: Any) -> bool:
    return train_mode(train) == SFT_MODE


def dpo_settings(train: Any) -> dict[str, Any] | None:
    """``beta``, ``label_smoothing``, ``loss`` and ``simpo_gamma`` of a DPO run's ``train.dpo`` (the default of a key it
    does not have or leaves unset), None for a run of another mode: what a checkpoint's pair scores and DPO result
    depend on."""
    if train_mode(train) != DPO_MODE:
        return None
    section = getattr(train, "dpo", None)
    read = section.get if isinstance(section, dict) else lambda key, default: getattr(section, key, default)
    settings = {}
    for key, default in DPO_DEFAULTS.items():
        value = read(key, default)
        settings[key] = default if value is None else type(default)(value)
    return settings


def scored_tokens(recipe: dict[str, Any]) -> str:
    """The tokens an SFT run's loss is over, for labels: the recipe's ``chat.loss`` (``assistant`` by default).

    ``recipe``: the run's recorded recipe (run.yaml), read as data: only one of
    :data:`core.eval_results.SCORED_TOKENS` comes back (anything else reads as ``loss_mask``, the column the scores
    follow)."""
    chat = recipe.get("chat") if isinstance(recipe, dict) else None
    loss = chat.get("loss", "assistant") if isinstance(chat, dict) else "assistant"
    return loss if loss in SCORED_TOKENS else "loss_mask"
