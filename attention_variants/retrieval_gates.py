"""Retrieval gates (DuoAttention's fit, to first order): per KV head and window, how much the
calibration answers' log-probability depends on the head seeing the whole context rather than its
sinks and the last W tokens.

DuoAttention gives each KV head a gate ``g`` mixing its full attention and its streaming attention,
``g * full + (1 - g) * streaming``, and fits the gates on synthetic retrieval prompts. Here every
gate sits at 1 (the model as it is) and one backward pass per prompt gives the gradient of the
answer's mean log-probability (teacher-forced) with respect to each gate: the first-order loss of
streaming that head alone (attribution patching). Since the mixed output is linear in ``g``, the
gradient is exact for the direction and one pass scores every window at once. A high score marks a
head whose stream would cost the answer most: a head to keep full. ``pruned_gate_order`` moves the
point the gradient is taken at: it streams the lowest-scored heads a share at a time and scores the
rest again with them streaming, so the heads kept are judged beside the others that stream.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_variants.projections import rotated_qkv
from foundation.perplexity import target_logprobs

ROW_CHUNK = 1024  # query rows per streaming attention: [heads, 1,024, T] scores at a time
PRUNE_SHARE = 0.25  # of the heads still full, streamed per step of ``pruned_gate_order``


class GatedAttention:
    """Each layer's attention forward replaced by full attention plus, per window, a gated term
    ``(g_w - 1) * (full - streaming_w)`` per KV head, with gradient; ``g_w`` = 1 (zero: the model as
    it is) unless ``at[w]`` sets it (0: that head streams)."""

    def __init__(self, model, windows: tuple[int, ...], sinks: int, at: dict[int, torch.Tensor] | None = None):
        cfg = model.config
        n, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.windows, self.sinks = windows, sinks
        self.gates = {w: (torch.ones(n, kvh) if at is None else at[w].detach().clone().float()).requires_grad_(True)
                      for w in windows}
        self._patched = []
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self._patched.append((attn, attn.forward))
            attn.forward = self._forward(attn, i)

    def _forward(self, attn, i: int):
        def forward(hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
            b, t, _ = hidden_states.shape
            q, k, v = rotated_qkv(attn, hidden_states, *position_embeddings)
            h, kvh = q.shape[1], k.shape[1]
            rep = h // kvh
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)  # [B, H, T, D]
            out = full
            for w in self.windows:
                if t <= w:
                    continue  # a window this long streams nothing here
                g = self.gates[w][i].repeat_interleave(rep).view(1, h, 1, 1)
                out = out + (g - 1) * self._streaming_change(full, q, k, v, w, attn.scaling)
            out = out.transpose(1, 2).reshape(b, t, -1)
            return attn.o_proj(out), None
        return forward

    @torch.no_grad()  # a constant direction: the gate's gradient needs no path through it
    def _streaming_change(self, full, q, k, v, w: int, scale: float) -> torch.Tensor:
        """``full - streaming_w`` per query head, ``[B, H, T, D]``: zero in the first ``w`` rows
        (they see no key beyond the window); the rest in chunks of ``ROW_CHUNK`` query rows."""
        t = q.shape[2]
        delta = torch.zeros_like(full)
        pos = torch.arange(t, device=q.device)
        for a in range(w, t, ROW_CHUNK):
            end = min(a + ROW_CHUNK, t)  # these rows see keys before ``end`` only
            rows, keys = pos[a:end, None], pos[None, :end]
            local = (rows >= keys) & ((rows - keys < w) | (keys < self.sinks))
            stream = F.scaled_dot_product_attention(q[:, :, a:end], k[:, :, :end], v[:, :, :end], attn_mask=local,
                                                    scale=scale)
            delta[:, :, a:end] = full[:, :, a:end] - stream
        return delta

    def remove(self) -> None:
        for attn, forward in self._patched:
            attn.forward = forward


def answer_logprob(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The mean log-probability of ``answer``'s tokens after ``prompt``, teacher-forced (differentiable)."""
    ids = torch.tensor([prompt + answer[:-1]])
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer)).logits[0]
    return target_logprobs(logits, torch.tensor(answer)).mean()


def retrieval_gate_scores(model, encoded: list[tuple[list[int], list[int]]], windows: tuple[int, ...],
                          sinks: int, at: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """Per window, ``[layers, kv_heads]``: the gradient of the answers' summed mean log-probability
    with respect to each head's gate at 1 (or at ``at[w]``), over ``encoded`` (``(prompt ids, answer
    ids)``); a transformers Llama-family model. Higher: streaming the head costs the answers more."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    probe = GatedAttention(model, windows, sinks, at)
    try:
        for prompt, answer in encoded:
            answer_logprob(model, prompt, answer).backward()
    finally:
        probe.remove()
        for p in params:
            p.requires_grad_(True)
    return {w: g.grad.detach().clone() if g.grad is not None else torch.zeros_like(g) for w, g in probe.gates.items()}


def pruned_gate_order(model, encoded: list[tuple[list[int], list[int]]], window: int, sinks: int,
                      share: float = PRUNE_SHARE, down_to: int = 1) -> list[tuple[int, int]]:
    """(layer, KV head), most worth keeping full first, the gates re-measured as heads stream: from
    every head full, stream the ``share`` of those still full whose gates score lowest, score again
    with them streaming, and so on until ``down_to`` are full (ranked by the last scores); the heads
    streamed follow, the last streamed first. One gate pass per step (the first is
    ``retrieval_gate_scores``'s), where a single pass scores each head against the model as it is."""
    if not 0 < share < 1:
        raise ValueError(f"share {share} must be in (0, 1)")
    gates = None
    streamed: list[tuple[int, int]] = []
    while True:
        at = None if gates is None else {window: gates}
        scores = retrieval_gate_scores(model, encoded, (window,), sinks, at)[window]
        if gates is None:
            gates = torch.ones_like(scores)
        full = sorted((tuple(lh) for lh in gates.nonzero().tolist()), key=lambda lh: scores[lh].item())
        if len(full) <= down_to:
            return full[::-1] + streamed[::-1]
        for lh in full[:min(len(full) - down_to, max(1, round(share * len(full))))]:
            gates[lh] = 0.0
            streamed.append(lh)
