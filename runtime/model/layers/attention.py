"""Self-attention over a flattened batch: projections, q/k norms and the queries' rotary here; the
attention itself (keys' rotary, cache write, causal/window masking, GQA) in the ``AttentionBackend``,
since the cache layout decides when a key is rotated."""
from __future__ import annotations

import torch
from torch import nn

from foundation.attention_layout import EntryPart
from runtime.attention.backend import AttentionBackend
from runtime.model.layers.small_ops import SmallOps


class Attention(nn.Module):
    """One layer's attention. ``qkv_proj(hidden)`` returns ``(q, k, v)`` (one fused GEMM or three
    Linears, ``runtime.model.layers.fused_linear``), or ``(q,)`` for a layer that reads another layer's
    KV: it passes ``k = v = None`` to the backend, which reads the owner's cache. A layer with streaming
    heads calls the backend once per attention entry, with that entry's heads."""

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
        parts: tuple[EntryPart, ...] | None = None,
        ops: SmallOps = SmallOps(),
    ) -> None:
        """``parts``: the attention entries the layer's KV heads split into (full heads, then
        streaming heads: ``AttentionLayout.entry_parts``); default one entry, ``layer_idx``."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.ops = ops
        self.parts = parts or (EntryPart(layer_idx, tuple(range(num_kv_heads))),)
        rep = num_heads // num_kv_heads
        # per part: its KV heads and query heads, as slices when contiguous, else index tensors
        # (buffers, so they follow the model's device)
        self._part_heads = []
        for i, p in enumerate(self.parts):
            kv = self._selection(f"part{i}_kv_heads", p.heads)
            self._part_heads.append((kv, self._selection(f"part{i}_q_heads", tuple(h * rep + r for h in p.heads
                                                                                     for r in range(rep)))))
        order = [h for p in self.parts for h in p.heads]
        self._unpermute = None if order == sorted(order) else self._selection("unpermute", tuple(
            j * rep + r for j in sorted(range(len(order)), key=order.__getitem__) for r in range(rep)))

    def _selection(self, name: str, index: tuple[int, ...]) -> slice | str:
        """A head selection: a slice when ``index`` is a contiguous ascending run, else the name of
        an index buffer."""
        if index == tuple(range(index[0], index[0] + len(index))):
            return slice(index[0], index[0] + len(index))
        self.register_buffer(name, torch.tensor(index, dtype=torch.long), persistent=False)
        return name

    def _select(self, x: torch.Tensor, selection: slice | str) -> torch.Tensor:
        return x[:, selection] if isinstance(selection, slice) else x.index_select(1, getattr(self, selection))

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """hidden ``[T, hidden]``; cos/sin ``[T, 1, head_dim]`` -> ``[T, hidden]``."""
        t = hidden.shape[0]
        proj = self.qkv_proj(hidden)
        q = proj[0].view(t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self.ops.rotary(q, cos, sin)
        k = v = None
        if len(proj) == 3:
            k = proj[1].view(t, self.num_kv_heads, self.head_dim)
            if self.k_norm is not None:
                k = self.k_norm(k)
            v = proj[2].view(t, self.num_kv_heads, self.head_dim)
        if len(self.parts) == 1:
            out = backend.attend(self.parts[0].entry, q, k, v)
        else:  # each entry attends with its own heads (and its own cache and window)
            out = torch.cat([backend.attend(p.entry, self._select(q, qh), self._select(k, kvh), self._select(v, kvh))
                             for p, (kvh, qh) in zip(self.parts, self._part_heads)], dim=1)
            if self._unpermute is not None:
                out = self._select(out, self._unpermute)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
