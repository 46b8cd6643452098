"""Model: token ids [batch, seq_len] -> next-token logits; a Llama-style decoder in plain PyTorch.

Parameter names match Hugging Face ``LlamaForCausalLM`` exactly (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj`` …, ``model.norm``, ``lm_head`` when untied), so the export is a
plain ``save_file(state_dict)`` and ``transformers`` loads it with no renaming. The maths follows the
HF reference: RMSNorm in fp32, rotate-half RoPE, SwiGLU MLP, grouped-query attention, causal SDPA. With
``position_ids`` (document masking, :mod:`trainer.loader.document_mask`) RoPE takes those positions and attention stays
within each document, as HF Llama does for packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import ModelDims
from trainer.loader.document_mask import document_attention_mask

IGNORE_INDEX = -100
"""Label value that cross-entropy skips (padding); the same value Hugging Face uses."""

INIT_STD = 0.02
"""Standard deviation of the normal init of embeddings and projections (GPT-2 / Llama convention)."""


@dataclass(frozen=True)
class ModelShape:
    """Everything needed to build the network: the config dims plus what the data decides."""

    dims: ModelDims
    vocab_size: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dims.hidden_size // self.dims.num_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in at least fp32 whatever the input dtype (as HF Llama does)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 for half inputs, float64 stays float64
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim] in fp32; recomputed per forward (cheap) so the model has no buffers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half convention (split halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [batch, heads, seq, head_dim] by position; cos/sin [seq, head_dim] or [batch, 1, seq, head_dim]."""
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention; k/v heads are repeated to match the query heads."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        dims = shape.dims
        self.head_dim = shape.head_dim  # head counts are read from the projections (fewer per TP process)
        self.q_proj = nn.Linear(dims.hidden_size, dims.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dims.hidden_size, dims.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dims.num_heads * self.head_dim, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: bool [batch, 1, seq, seq], True where a query may attend a key; None = causal."""
        batch, seq_len, _ = x.shape
        # Head counts come from the projections' widths: under tensor parallelism each process holds
        # num_heads / tp query heads and num_kv_heads / tp kv heads (whole heads, same grouping).
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(shape)
        self.mlp = LlamaMLP(shape.dims)
        self.input_layernorm = RMSNorm(shape.dims.hidden_size, shape.dims.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.dims.hidden_size, shape.dims.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding + decoder stack + final norm (HF's ``model.`` prefix)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.dims.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape) for _ in range(shape.dims.num_layers))
        self.norm = RMSNorm(shape.dims.hidden_size, shape.dims.rms_norm_eps)
        self.head_dim, self.rope_theta = shape.head_dim, shape.dims.rope_theta
        self.activation_checkpointing = False
        """Recompute each block's activations during backward instead of keeping them (set by the trainer)."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` [batch, seq]: each token's position in its document (0 starts one); None = one sequence."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(input_ids.shape[1], self.head_dim, self.rope_theta, input_ids.device)
        mask = None
        if position_ids is not None:  # the tables' rows at each token's position: [batch, 1, seq, head_dim]
            cos, sin = cos[position_ids][:, None], sin[position_ids][:, None]
            mask = document_attention_mask(position_ids)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            # Non-reentrant checkpointing: works with DDP/FSDP hooks and inputs that need no grad.
            if recompute:
                hidden = checkpoint(layer, hidden, cos, sin, mask, use_reentrant=False)
            else:
                hidden = layer(hidden, cos, sin, mask)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Decoder + output projection. Tied weights reuse ``embed_tokens.weight`` (no ``lm_head`` key at all)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = LlamaModel(shape)
        # Tied: no lm_head module, so the state_dict has no shared tensors (safetensors refuses those)
        # and matches HF's tied layout, where lm_head.weight is absent from the file.
        self.lm_head = None if shape.dims.tie_word_embeddings else nn.Linear(
            shape.dims.hidden_size, shape.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] or, with ``labels`` [batch, seq], the mean next-token loss.

        Labels are shifted inside, as in HF: position t predicts ``labels[t + 1]``; ``IGNORE_INDEX`` is skipped.
        ``position_ids``: document masking (see :meth:`LlamaModel.forward`).
        """
        hidden = self.model(input_ids, position_ids)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        if labels is None:
            return logits
        return next_token_loss(logits, labels)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of position t's logits against ``labels[t + 1]`` in fp32, skipping IGNORE_INDEX.

    The labels are shifted (the last position of each row gets IGNORE_INDEX), not the logits, as
    transformers' ``ForCausalLMLoss`` does: slicing ``logits[:, :-1]`` copied the [batch, seq, vocab] logits
    and its backward filled another copy, 9% of a tiny-preset step on CPU. ``reduction="none"`` gives one
    loss per position, 0 at each row's last.
    """
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), shifted.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def build_model(shape: ModelShape, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model; the same ``seed`` gives bitwise the same weights on any machine's CPU.

    Init uses its own generator (not the global RNG): N(0, 0.02) for embeddings and projections, the
    residual output projections (o_proj, down_proj) scaled by 1/sqrt(2 * num_layers) as in GPT-2, norms at 1.
    """
    model = LlamaForCausalLM(shape)
    generator = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * shape.dims.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def flops_per_token(shape: ModelShape, num_params: int) -> float:
    """Training FLOPs per token: 6 * params plus attention's 12 * layers * hidden * seq_len (PaLM appendix B)."""
    dims = shape.dims
    return 6.0 * num_params + 12.0 * dims.num_layers * dims.hidden_size * shape.max_seq_len
