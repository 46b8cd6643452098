"""Sample text from an exported ``model/`` (config.json + safetensors + tokenizer files), any architecture.

The export is loaded the way continued pretraining loads a model folder (:mod:`trainer.model.hf_model`: checked
config, safetensors only, nothing unpickled), so the built-in model's Llama export and a Hugging Face model's
export in its own architecture generate alike.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from core.errors import CheckpointError, ConfigError
from core.layout import HF_CONFIG_FILE, TOKENIZER_FILE
from tokenization.special_tokens import SpecialTokens, load_tokenizer, model_special_tokens
from trainer.model.hf_model import build_hf_model, load_causal_lm_config, load_pretrained_weights, text_config
from trainer.model.sampling_options import check_sampling
from trainer.model.spec import output_logits


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


@torch.no_grad()
def generate_text(model: nn.Module, tokenizer: Tokenizer, special: SpecialTokens, context_len: int, prompt: str, *,
                  max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """Continue ``prompt`` by sampling (temperature 0 = greedy); stops at end-of-document.

    The model saw every document right after an end-of-document token (and its BOS, when the tokenizer adds
    one), so generation starts from them. Raises ConfigError for a setting :func:`check_sampling` refuses.
    """
    check_sampling(prompt, temperature, seed)
    start = [special.eos_id] + ([special.bos_id] if special.bos_id is not None else [])
    ids = [*start, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    generator = torch.Generator().manual_seed(seed)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new_ids)[-context_len:]])
        logits = output_logits(model(context))[0, -1].float()
        next_id = _pick(logits, temperature, top_k, generator)
        if next_id == special.eos_id:
            break
        new_ids.append(next_id)
    return prompt + tokenizer.decode(new_ids)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits, min(top_k, logits.numel()))
    # In float64 (a float32 tensor rounds 1e-300 to 0, and x / 0 is NaN) and shifted so the largest is 0: a tiny
    # temperature then sends the others to -inf (greedy in the limit) instead of overflowing softmax to NaN.
    probabilities = torch.softmax((values.double() - values[0].double()) / temperature, dim=-1)
    return int(indices[torch.multinomial(probabilities, 1, generator=generator)])
