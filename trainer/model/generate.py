"""Sample text from an exported ``model/`` (config.json + safetensors + tokenizer files), any architecture.

The export is loaded the way continued pretraining loads a model folder (:mod:`trainer.model.hf_model`: checked
config, safetensors only, nothing unpickled), so the built-in model's Llama export and a Hugging Face model's
export in its own architecture generate alike.

A model with a chat template (the export of a supervised fine-tuning run) can also chat (:func:`chat_reply`): the
user's message is rendered through the template with the assistant's generation prompt, exactly as training
rendered conversations, and the reply is sampled up to the template's end-of-turn token. The template is Jinja from
the model folder, rendered by transformers in its sandboxed environment (as ``lm_eval --apply_chat_template`` and
``pipeline()`` render it), and only when the user asks for chat.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer
from torch import nn

from core.errors import CheckpointError, ConfigError
from core.layout import HF_CONFIG_FILE, TOKENIZER_FILE
from tokenization.special_tokens import SpecialTokens, load_tokenizer, model_special_tokens
from trainer.model.hf_files import require_chat_template
from trainer.model.hf_model import build_hf_model, load_causal_lm_config, load_pretrained_weights, text_config
from trainer.model.sampling_options import check_sampling
from trainer.model.spec import output_logits

if TYPE_CHECKING:
    from tokenization.chat.template import ChatTemplate


def load_exported_model(model_dir: str | Path) -> tuple[nn.Module, Tokenizer, SpecialTokens, int]:
    """(model in eval mode, tokenizer, its special ids, context length) from an export folder."""
    model_dir = Path(model_dir)
    missing = [name for name in (HF_CONFIG_FILE, TOKENIZER_FILE) if not (model_dir / name).is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: export lacks {missing}; run `tokenmill train` to export the model.")
    try:
        config = load_causal_lm_config(model_dir)
        model = build_hf_model(config, seed=0)
        load_pretrained_weights(model, model_dir)
    except ConfigError as err:
        raise CheckpointError(f"{err} (exported model; re-run `tokenmill train` to export it again)") from None
    tokenizer = load_tokenizer(model_dir / TOKENIZER_FILE)
    context = getattr(text_config(config), "max_position_embeddings", None) or 1024
    return model.eval(), tokenizer, model_special_tokens(model_dir, tokenizer), int(context)


def generate_text(model: nn.Module, tokenizer: Tokenizer, special: SpecialTokens, context_len: int, prompt: str, *,
                  max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """Continue ``prompt`` by sampling (temperature 0 = greedy); stops at end-of-document.

    The model saw every document right after an end-of-document token (and its BOS, when the tokenizer adds
    one), so generation starts from them. Raises ConfigError for a setting :func:`check_sampling` refuses.
    """
    check_sampling(prompt, temperature, seed)
    start = [special.eos_id] + ([special.bos_id] if special.bos_id is not None else [])
    ids = [*start, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    new_ids = sample_ids(model, ids, {special.eos_id}, context_len, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, seed=seed)
    return prompt + tokenizer.decode(new_ids)


def load_chat_template_of(model_dir: str | Path) -> ChatTemplate:
    """The export's chat template, checked against its tokenizer (:mod:`tokenization.chat.template`).

    Raises ConfigError naming the folder when it has none (:func:`trainer.model.hf_files.require_chat_template`).
    """
    from tokenization.chat.template import load_chat_template  # transformers: only to chat

    return load_chat_template(require_chat_template(Path(model_dir)))


def chat_reply(model: nn.Module, template: ChatTemplate, context_len: int, message: str, *,
               max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """The assistant's reply to one user ``message``: the template renders it with the generation prompt, the model
    samples until a special token (the template's end of turn: ``<|endoftext|>``, ``<|im_end|>``, ``<|eot_id|>``)
    or ``max_new_tokens``; the reply is the decoded new tokens, without that end token."""
    check_sampling(message, temperature, seed)
    ids = template.render_ids([{"role": "user", "content": message}], add_generation_prompt=True)
    eos_id = template.tokenizer.eos_token_id
    stop = set(template.special_token_ids) | ({eos_id} if eos_id is not None else set())
    new_ids = sample_ids(model, ids, stop, context_len, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_k=top_k, seed=seed)
    return template.tokenizer.decode(new_ids, skip_special_tokens=True)


@torch.no_grad()
def sample_ids(model: nn.Module, ids: list[int], stop_ids: set[int], context_len: int, *, max_new_tokens: int,
               temperature: float, top_k: int, seed: int) -> list[int]:
    """The tokens sampled after ``ids``, up to (not including) the first of ``stop_ids`` or ``max_new_tokens``."""
    generator = torch.Generator().manual_seed(seed)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new_ids)[-context_len:]])
        logits = output_logits(model(context))[0, -1].float()
        next_id = _pick(logits, temperature, top_k, generator)
        if next_id in stop_ids:
            break
        new_ids.append(next_id)
    return new_ids


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits, min(top_k, logits.numel()))
    # In float64 (a float32 tensor rounds 1e-300 to 0, and x / 0 is NaN) and shifted so the largest is 0: a tiny
    # temperature then sends the others to -inf (greedy in the limit) instead of overflowing softmax to NaN.
    probabilities = torch.softmax((values.double() - values[0].double()) / temperature, dim=-1)
    return int(indices[torch.multinomial(probabilities, 1, generator=generator)])
