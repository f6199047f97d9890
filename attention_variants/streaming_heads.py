"""Streaming KV heads (DuoAttention): which heads of which layers may see only sinks + a window.

Each KV head is scored on calibration text by what streaming it would lose, and the lowest-scored
fraction of all heads (ranked across layers) streams. Two scores, both measured in one pass with
the heads' own projections (any attention implementation):

- ``mass``: the attention probability its query heads put on keys at least W tokens back, the sink
  keys counted as lost too (the rule ``--global-select calib`` ranks whole layers by);
- ``output``: the layer-local loss DuoAttention fits its gates on: the squared change of the
  layer's attention output (after ``o_proj``) when this head alone streams, relative to that output's
  energy.

The choice is written as the config's ``streaming_heads`` (``foundation.attention_layout``); the
weights stay as they are.
"""
from __future__ import annotations

from typing import Literal

import torch

from attention_variants.projections import rotated_qkv
from foundation.errors import KvslimError

StreamingSelect = Literal["mass", "output"]
STREAMING_SELECTS: tuple[str, ...] = ("mass", "output")
# "mass" is the default: on the dev slice (served, bf16 KV, context 2,048) it trails "output" by 0.1 point
# at 45 of 90 heads and leads it by 3 points at 68 and 75 (benchmarks/results/streaming_heads_served.json).
# DuoAttention keeps ~25% of KV heads full in MHA models and ~50% in GQA ones.
AUTO_FRACTION = {"mha": 0.75, "gqa": 0.5}
# Query rows a head is scored from: every row up to this many, else this many evenly spaced (the
# scores are means over rows; at 8,192 tokens all rows would form [heads, 8192, 8192] per window).
MAX_QUERY_ROWS = 2048


def query_rows(seq_len: int) -> torch.Tensor:
    """The query positions scored in a ``seq_len``-token sequence: all, or ``MAX_QUERY_ROWS`` evenly
    spaced ending at the last (the rows that see the most keys beyond a window)."""
    stride = -(-seq_len // MAX_QUERY_ROWS)
    return torch.arange(seq_len - 1, -1, -stride).flip(0)


def auto_fraction(num_heads: int, num_kv_heads: int) -> float:
    """``--streaming-heads auto``: DuoAttention's streaming share for the model's attention type."""
    return AUTO_FRACTION["gqa" if num_kv_heads < num_heads else "mha"]


class HeadScoreProbe:
    """Forward pre-hooks on every layer's attention that score each KV head, for each window, from
    the layer's own q/k/v (rotated as the layer rotates them) on each sequence the model runs."""

    def __init__(self, model, windows: tuple[int, ...], sinks: int, num_seqs: int):
        cfg = model.config
        n, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.windows, self.sinks, self.num_seqs = windows, sinks, num_seqs
        self.scores = {w: {name: torch.zeros(n, kvh) for name in STREAMING_SELECTS} for w in windows}
        self._hooks = [layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                       for i, layer in enumerate(model.model.layers)]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            for w, (mass, output) in self._score(module, hidden.detach().float(), cos.float(), sin.float()).items():
                self.scores[w]["mass"][i] += mass / self.num_seqs
                self.scores[w]["output"][i] += output / self.num_seqs
        return hook

    def _score(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> dict:
        d, t = attn.head_dim, x.shape[1]
        q, k, v = rotated_qkv(attn, x, cos, sin)
        v = v[0]  # [KVH, T, D]
        h, kvh = q.shape[1], k.shape[1]
        rep = h // kvh
        k, v = k[0].repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [H, T, D]
        rows = query_rows(t)
        pos = torch.arange(t)
        dist = rows[:, None] - pos[None, :]  # [R, T]
        causal = dist >= 0
        scores = (q[0, :, rows] @ k.transpose(1, 2)) * attn.scaling  # [H, R, T]
        p_full = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        wo = attn.o_proj.weight.float().view(-1, h, d)  # [hidden, H, D]
        o_full = p_full @ v
        energy = torch.einsum("htd,ohd->to", o_full, wo).pow(2).sum().clamp_min(1e-30)
        out = {}
        for w in self.windows:
            local = causal & ((dist < w) | (pos[None, :] < self.sinks))
            beyond = rows >= w  # the queries a window of w can make lose anything
            mass = (p_full[:, beyond] * (dist[beyond] >= w)).sum(-1).mean(-1)  # [H]; sink keys counted lost
            p_local = torch.softmax(scores.masked_fill(~local, float("-inf")), -1)
            delta = torch.einsum("htd,ohd->hto", p_local @ v - o_full, wo)  # per query head, [H, R, hidden]
            per_kv = delta.view(kvh, rep, len(rows), -1).sum(1)  # [KVH, R, hidden]
            out[w] = (mass.view(kvh, rep).mean(-1), per_kv.pow(2).sum((1, 2)) / energy)
        return out

    def remove(self) -> dict[int, dict[str, torch.Tensor]]:
        """Remove the hooks; per window, per score, ``[layers, kv_heads]``."""
        for hook in self._hooks:
            hook.remove()
        return self.scores


@torch.no_grad()
def head_scores_by_window(model, ids: torch.Tensor, windows: tuple[int, ...], sinks: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per window, per score name, ``[layers, kv_heads]`` on ``ids`` ``[num_seqs, seq_len]``
    (sequences longer than every window), in one pass; a transformers Llama-family model."""
    if ids.shape[1] <= max(windows):
        raise KvslimError(f"calibration sequences of {ids.shape[1]} tokens cannot score heads for window {max(windows)}")
    probe = HeadScoreProbe(model, windows, sinks, ids.shape[0])
    try:
        for row in ids:
            model(input_ids=row.unsqueeze(0), use_cache=False)
    finally:
        scores = probe.remove()
    return scores


def head_scores(model, ids: torch.Tensor, window: int, sinks: int) -> dict[str, torch.Tensor]:
    """``head_scores_by_window`` for one window."""
    return head_scores_by_window(model, ids, (window,), sinks)[window]


def streaming_kv_heads(score: torch.Tensor, fraction: float,
                       layers: list[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per layer, the KV heads that stream: the ``fraction`` of all heads of ``layers`` (default
    every layer) with the lowest ``score`` ``[layers, kv_heads]`` (ties broken by position)."""
    kvh = score.shape[1]
    eligible = torch.zeros_like(score, dtype=torch.bool)
    eligible[list(range(score.shape[0])) if layers is None else layers] = True
    n = round(fraction * int(eligible.sum()))
    ranked = score.masked_fill(~eligible, float("inf")).flatten().argsort(stable=True)
    chosen = set(ranked[:n].tolist())
    return tuple(tuple(h for h in range(kvh) if layer * kvh + h in chosen) for layer in range(score.shape[0]))
