"""Rotary position embeddings (rotate-half convention, as transformers applies them)."""
from __future__ import annotations

import torch
from torch import nn

from runtime.model.spec import RopeSpec


def rope_frequencies(rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] fp32, attention_scaling)`` for one rope.

    Scaled rope types (linear, llama3, yarn, longrope) use transformers' own initialisers, so the
    frequencies are the library's by construction.
    """
    if rope.rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (rope.theta**exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope.as_dict(),
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](cfg, None)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin for a flattened batch of positions; computed per forward (no length-sized table)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: derived from the config, not a weight.
        self.inv_freq, self.attention_scaling = rope_frequencies(rope, head_dim, max_position_embeddings)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> ``(cos, sin)`` each ``[T, 1, head_dim]`` in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, head_dim]``; cos/sin ``[T, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
