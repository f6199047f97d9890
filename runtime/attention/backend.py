"""The contract between the decoder (model side) and the KV cache (engine side).

The decoder runs on a *flattened* batch, as vLLM and nano-vllm do: the new tokens of every
sequence in the step are concatenated into one dimension ``T`` (no padding). It computes q/k/v
and rotary, then hands attention to a backend, which owns the cache and the step's metadata
(which tokens belong to which sequence, their positions, block tables):

    out = backend.attend(layer_idx, q, k, v)

- ``q``: ``[T, num_heads, head_dim]`` after rotary and norms; ``k``, ``v``: ``[T, num_kv_heads,
  head_dim]`` after norms, k *before* rotary when the layer's ``AttentionParams.key_rope`` is set
  (the backend rotates keys: a cache layout may store them before RoPE), or ``None`` for a layer
  that reads another layer's KV (``AttentionLayout.layers[i].kv_source != i``); the backend then
  reads the owner's cache, with the owner's key rope.
- The backend writes the new k/v into its cache (quantizing on write when the cache is FP8/INT8),
  then computes causal attention of each new token over its sequence's cached context, honouring
  the layer's sliding window, GQA head mapping, the softmax scale and optional logit softcap.
- Returns ``[T, num_heads, head_dim]`` in q's dtype.

Implementations (``runtime.attention.registry``): the torch paged backend (SDPA over the blocks)
and the kernel backend (Triton on CUDA). Both are tested against ``reference_attention`` below,
the one plain-torch definition of the attention the decoder asks for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.attention.key_rope import KeyRope


@dataclass(frozen=True)
class AttentionParams:
    """Per-layer constants the backend needs (from ``ModelSpec``)."""

    scale: float
    window: int | None  # None = full attention; else attend to itself and window-1 earlier tokens
    kv_source: int  # layer whose cache holds this layer's K/V
    softcap: float | None = None
    sinks: int = 0  # with a window: the first ``sinks`` positions stay visible too
    key_rope: KeyRope | None = None  # None: k arrives rotated (or the model has no rotary)


class AttentionBackend(Protocol):
    """``attend`` per layer; a backend that rotates the step's new keys may also take the decoder's
    cos/sin for the step (``share_rotary({(KeyRope, dtype): (cos, sin)})``, called before the layers)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor: ...


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: int = 0,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain-torch causal attention for one sequence, in fp32.

    q ``[Tq, H, D]``; k, v ``[Tk, KVH, D]``; positions are absolute token indices. Query i attends
    key j when ``k_pos[j] <= q_pos[i]`` and, with a window W, ``q_pos[i] - k_pos[j] < W`` or
    ``k_pos[j] < sinks``. ``own`` (k, v ``[Tq, KVH, D]``): query i reads its own position's key and
    value from row i of these instead (a decode step's exact own row over a quantized context).
    """
    h, kvh = q.shape[1], k.shape[1]
    rep = h // kvh
    qf = q.float().transpose(0, 1)  # [H, Tq, D]
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, Tq, Tk]
    if own is not None:
        rows = torch.arange(q.shape[0], device=q.device)
        cols = (k_positions.view(1, -1) == q_positions.view(-1, 1)).int().argmax(-1)  # each query's own key
        own_k, own_v = (t.float().repeat_interleave(rep, dim=1).transpose(0, 1) for t in own)  # [H, Tq, D]
        scores[:, rows, cols] = (qf * own_k).sum(-1) * scale
        vf_own = own_v - vf[:, cols]  # [H, Tq, D]: what reading its own row exact adds
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    dist = q_positions.view(-1, 1) - k_positions.view(1, -1)
    allowed = dist >= 0
    if window is not None:
        allowed &= (dist < window) | (k_positions.view(1, -1) < sinks)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = probs @ vf  # [H, Tq, D]
    if own is not None:
        out = out + probs[:, rows, cols].unsqueeze(-1) * vf_own
    return out.transpose(0, 1).to(q.dtype)
