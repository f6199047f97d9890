"""Self-attention over a flattened batch: projections, q/k norms and the queries' rotary here; the
attention itself (keys' rotary, cache write, causal/window masking, GQA) in the ``AttentionBackend``,
since the cache layout decides when a key is rotated."""
from __future__ import annotations

import torch
from torch import nn

from runtime.attention.backend import AttentionBackend
from runtime.attention.key_rope import apply_rotary


class Attention(nn.Module):
    """One layer's attention. ``qkv_proj(hidden)`` returns ``(q, k, v)`` (one fused GEMM or three
    Linears, ``runtime.model.layers.fused_linear``), or ``(q,)`` for a layer that reads another layer's
    KV: it passes ``k = v = None`` to the backend, which reads the owner's cache."""

    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_proj: nn.Module,
        o_proj: nn.Module,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """hidden ``[T, hidden]``; cos/sin ``[T, 1, head_dim]`` -> ``[T, hidden]``."""
        t = hidden.shape[0]
        proj = self.qkv_proj(hidden)
        q = proj[0].view(t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        k = v = None
        if len(proj) == 3:
            k = proj[1].view(t, self.num_kv_heads, self.head_dim)
            if self.k_norm is not None:
                k = self.k_norm(k)
            v = proj[2].view(t, self.num_kv_heads, self.head_dim)
        out = backend.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
