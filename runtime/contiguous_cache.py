"""A simple KV cache: one contiguous K and V tensor per sequence and cache-owning layer.

Implements the ``AttentionBackend`` contract (``runtime/attention_backend.py``). Usage per step::

    cache.add_sequence(seq_id, capacity)             # once per sequence
    positions = cache.begin_step([(seq_id, n_new), ...])   # tokens flattened in this order
    hidden = model(input_ids, positions, cache)      # each layer calls cache.attend(...)

Layers that read another layer's KV use the owner's tensors; sliding layers attend to the last
``window`` positions (the cache keeps every position: paging and window freeing are the
engine's job).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foundation.errors import KvslimError
from runtime.attention_backend import AttentionParams
from runtime.spec import ModelSpec


@dataclass(frozen=True)
class _StepEntry:
    seq_id: int
    start: int  # tokens cached before this step
    num_new: int
    offset: int  # first row of this sequence in the flattened batch


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool ``[Tq, Tk]``: True where query i may attend key j (causal, optional window)."""
    dist = q_pos[:, None] - k_pos[None, :]
    allowed = dist >= 0
    if window is not None:
        allowed &= dist < window
    return allowed


def sequence_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, params: AttentionParams, k_start: int
) -> torch.Tensor:
    """Attention of ``q [n, H, D]`` (positions ``start..start+n-1``) over ``k, v [L, KVH, D]``
    (positions ``k_start..k_start+L-1``) -> ``[n, H, D]``."""
    n, heads, _ = q.shape
    kv_heads = k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if params.softcap is None:
        # 4-D inputs select torch's fused CPU (flash) kernel; 3-D ones fall back to the math path.
        mask, causal = None, False
        if n > 1 and params.window is None and start == k_start and k.shape[0] == n:
            causal = True
        elif n > 1 or params.window is not None and k.shape[0] > params.window:
            q_pos = torch.arange(start, start + n)
            k_pos = torch.arange(k_start, k_start + k.shape[0])
            mask = attention_mask(q_pos, k_pos, params.window)
        out = F.scaled_dot_product_attention(
            qh[None], kh[None], vh[None], attn_mask=mask, is_causal=causal, scale=params.scale,
            enable_gqa=heads != kv_heads,
        )
        return out[0].transpose(0, 1)
    rep = heads // kv_heads
    kh = kh.repeat_interleave(rep, dim=0)
    vh = vh.repeat_interleave(rep, dim=0)
    scores = (qh.float() @ kh.float().transpose(1, 2)) * params.scale
    scores = torch.tanh(scores / params.softcap) * params.softcap
    q_pos = torch.arange(start, start + n)
    k_pos = torch.arange(k_start, k_start + k.shape[0])
    scores = scores.masked_fill(~attention_mask(q_pos, k_pos, params.window), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh.float()
    return out.to(q.dtype).transpose(0, 1)


class ContiguousKVCache:
    """Per-sequence contiguous KV tensors ``[capacity, num_kv_heads, head_dim]`` per owner layer."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        self.spec = spec
        self.dtype = dtype
        self.params = [spec.attention_params(i) for i in range(spec.num_layers)]
        self.owners = spec.attention.cache_owners()
        self._k: dict[int, dict[int, torch.Tensor]] = {}
        self._v: dict[int, dict[int, torch.Tensor]] = {}
        self._len: dict[int, int] = {}
        self._step: list[_StepEntry] = []

    # --- sequences ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, capacity: int) -> None:
        """Reserve room for ``capacity`` tokens of a new sequence."""
        if seq_id in self._len:
            raise KvslimError(f"sequence {seq_id} is already in the cache")
        self._k[seq_id], self._v[seq_id] = {}, {}
        for i in self.owners:
            shape = (capacity, self.spec.num_kv_heads(i), self.spec.head_dim)
            self._k[seq_id][i] = torch.empty(shape, dtype=self.dtype)
            self._v[seq_id][i] = torch.empty(shape, dtype=self.dtype)
        self._len[seq_id] = 0

    def free(self, seq_id: int) -> None:
        del self._k[seq_id], self._v[seq_id], self._len[seq_id]

    def length(self, seq_id: int) -> int:
        return self._len[seq_id]

    def capacity(self, seq_id: int) -> int:
        return next(iter(self._k[seq_id].values())).shape[0]

    def bytes_used(self) -> int:
        """Bytes of the KV tensors currently allocated."""
        return sum(t.numel() * t.element_size() for d in (self._k, self._v) for s in d.values() for t in s.values())

    # --- one forward step --------------------------------------------------------------------
    def begin_step(self, batch: list[tuple[int, int]]) -> torch.Tensor:
        """Plan a step: ``batch`` lists ``(seq_id, num_new_tokens)`` in flattened order.

        Returns the positions ``int64 [T]`` of the new tokens (each sequence continues where
        its cache ends). The lengths advance now; the layers fill the new slots during forward.
        """
        self._step = []
        positions = []
        offset = 0
        for seq_id, n in batch:
            start = self._len[seq_id]
            if start + n > self.capacity(seq_id):
                raise KvslimError(f"sequence {seq_id}: {start + n} tokens exceed its reserved {self.capacity(seq_id)}")
            self._step.append(_StepEntry(seq_id, start, n, offset))
            positions.append(torch.arange(start, start + n))
            self._len[seq_id] = start + n
            offset += n
        return torch.cat(positions) if positions else torch.empty(0, dtype=torch.long)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        params = self.params[layer_idx]
        src = params.kv_source
        outs = []
        for e in self._step:
            kc, vc = self._k[e.seq_id][src], self._v[e.seq_id][src]
            rows = slice(e.offset, e.offset + e.num_new)
            end = e.start + e.num_new
            if k is not None:
                kc[e.start:end] = k[rows]
                vc[e.start:end] = v[rows]
            lo = 0 if params.window is None else max(0, e.start - params.window + 1)
            outs.append(sequence_attention(q[rows], kc[lo:end], vc[lo:end], e.start, params, lo))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
