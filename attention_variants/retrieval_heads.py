"""Retrieval heads (DuoAttention's reason for keeping some heads full): which KV heads carry a fact
from far back to the question about it.

Each KV head is scored on synthetic retrieval prompts (``eval.retrieval_task``, the calibration
wording): the attention probability its query heads put on the fact's tokens from the prompt's
last tokens, where the answer is about to be produced. A head that streams (sinks + a window) can
see no such fact once it lies beyond the window; a high score marks a head to keep full. Scored
with the heads' own projections, rotated as each layer rotates them, over every prompt; only the
last rows of each attention matrix are formed.
"""
from __future__ import annotations

import torch

from attention_variants.projections import rotated_qkv

QUERY_ROWS = 8  # the prompt's last tokens: where the question ends and the answer starts


class RetrievalHeadProbe:
    """Forward pre-hooks on every layer's attention that add, per KV head, the attention mass the
    last ``QUERY_ROWS`` queries put on ``fact`` token positions (set before each prompt runs)."""

    def __init__(self, model):
        cfg = model.config
        self.scores = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads)
        self.fact: torch.Tensor | None = None  # [T] bool: the asked fact's tokens
        self.prompts = 0
        self._hooks = [layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                       for i, layer in enumerate(model.model.layers)]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            self.scores[i] += self._mass(module, hidden.detach().float(), cos.float(), sin.float())
        return hook

    def _mass(self, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, _ = rotated_qkv(attn, x, cos, sin)
        h, kvh = q.shape[1], k.shape[1]
        rows = min(QUERY_ROWS, t)
        qq = q[0, :, t - rows:]  # [H, rows, D]
        kk = k[0].repeat_interleave(h // kvh, 0)  # [H, T, D]
        scores = (qq @ kk.transpose(1, 2)) * attn.scaling  # [H, rows, T]
        future = torch.arange(t) > torch.arange(t - rows, t)[:, None]  # [rows, T]: causal, as the model reads
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        mass = probs[:, :, self.fact].sum(-1).mean(-1)  # [H]
        return mass.view(kvh, h // kvh).mean(-1)

    def remove(self) -> torch.Tensor:
        """Remove the hooks; ``[layers, kv_heads]``, the mean over the prompts run."""
        for hook in self._hooks:
            hook.remove()
        return self.scores / max(1, self.prompts)


@torch.no_grad()
def retrieval_head_scores(model, tokenizer, prompts) -> torch.Tensor:
    """``[layers, kv_heads]`` mean fact mass over ``prompts`` (``eval.retrieval_task.RetrievalPrompt``)
    for a transformers Llama-family model."""
    probe = RetrievalHeadProbe(model)
    try:
        for p in prompts:
            enc = tokenizer(p.text, add_special_tokens=False, return_offsets_mapping=True)
            spans = torch.tensor(enc["offset_mapping"])
            lo, hi = p.fact_span
            probe.fact = (spans[:, 0] < hi) & (spans[:, 1] > lo)
            probe.prompts += 1
            model(input_ids=torch.tensor([enc["input_ids"]]), use_cache=False)
    finally:
        scores = probe.remove()
    return scores
