"""The decoder's rotary embedding: cos/sin of a step's positions per rope (the math in
``runtime.attention.key_rope``, shared with the backends' key rotation)."""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention.key_rope import rope_frequencies, rotary_cos_sin
from runtime.model.spec import RopeSpec


class RotaryEmbedding(nn.Module):
    """cos/sin for a flattened batch of positions; computed per forward (no length-sized table)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = rope_frequencies(rope, head_dim, max_position_embeddings)
        # A buffer that no checkpoint holds: it follows the model to its device (a CUDA graph
        # cannot copy it there on every forward).
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> ``(cos, sin)`` each ``[T, 1, head_dim]`` in ``dtype``."""
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.attention_scaling, dtype)
        return cos[:, None, :], sin[:, None, :]
