"""The decoder's rotary embedding: cos/sin of a step's positions per rope (the math in
``runtime.attention.key_rope``, shared with the backends' key rotation)."""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention.key_rope import KeyRope, rope_frequencies, rotary_cos_sin
from runtime.model.spec import RopeSpec


class RotaryEmbedding(nn.Module):
    """cos/sin for a flattened batch of positions; computed per forward (no length-sized table)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: derived from the config, not a weight (resident weight
        # bytes count buffers). Copied once per device on first use, so a CUDA graph captured after
        # a warm-up step copies nothing.
        self.inv_freq, self.attention_scaling = rope_frequencies(rope, head_dim, max_position_embeddings)
        self.key_rope = KeyRope(tuple(self.inv_freq.tolist()), self.attention_scaling)  # the backends' name for it
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]`` -> ``(cos, sin)`` each ``[T, 1, head_dim]`` in ``dtype``."""
        inv_freq = self._inv_freq_on.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        cos, sin = rotary_cos_sin(positions, inv_freq, self.attention_scaling, dtype)
        return cos[:, None, :], sin[:, None, :]
