"""Sample text from an exported ``model/`` (config.json + model.safetensors + tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from core.errors import CheckpointError
from trainer.config import ModelDims
from trainer.model import LlamaForCausalLM, ModelShape

EOS_TOKEN = "<|endoftext|>"


def load_exported_model(model_dir: str | Path) -> tuple[LlamaForCausalLM, Tokenizer]:
    """Rebuild tokenmill's model from an export (safetensors only: nothing is unpickled)."""
    model_dir = Path(model_dir)
    files = [model_dir / name for name in ("config.json", "model.safetensors", "tokenizer.json")]
    missing = [path.name for path in files if not path.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir}: export lacks {missing}; run `tokenmill train` to export the model.")
    config = json.loads(files[0].read_text(encoding="utf-8"))
    dims = ModelDims(hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
                     num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                     intermediate_size=config["intermediate_size"], rope_theta=config["rope_theta"],
                     rms_norm_eps=config["rms_norm_eps"], tie_word_embeddings=config["tie_word_embeddings"])
    model = LlamaForCausalLM(ModelShape(dims, config["vocab_size"], config["max_position_embeddings"]))
    model.load_state_dict(load_file(files[1]), strict=True)
    return model.eval(), Tokenizer.from_file(str(files[2]))


@torch.no_grad()
def generate_text(model: LlamaForCausalLM, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 100,
                  temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """Continue ``prompt`` by sampling (temperature 0 = greedy); stops at end-of-document.

    The model saw every document right after an end-of-document token, so generation starts from one.
    """
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    ids = [eos_id, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    generator = torch.Generator().manual_seed(seed)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new_ids)[-model.shape.max_seq_len:]])
        logits = model(context)[0, -1].float()
        next_id = _pick(logits, temperature, top_k, generator)
        if next_id == eos_id:
            break
        new_ids.append(next_id)
    return prompt + tokenizer.decode(new_ids)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    values, indices = torch.topk(logits, min(top_k, logits.numel()))
    probabilities = torch.softmax(values / temperature, dim=-1)
    return int(indices[torch.multinomial(probabilities, 1, generator=generator)])
