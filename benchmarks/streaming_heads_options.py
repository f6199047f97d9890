"""Streaming KV heads (sinks + window) chosen per head vs per layer, simulated in the transformers
model on the dev slice (never evaluation text), before the runtime carries per-head caches.

Each KV head is *full* or *streaming*: a streaming head's queries see the first ``--sinks`` keys
and the last ``--window``. Heads are ranked by a calibration score on ``wikipedia:calib`` (the
same 2 x 1,024 tokens ``compress convert`` calibrates on): the attention mass their query heads put
outside sinks + window (``far``), or the same with the sink keys counted as lost (``far_sinks``,
the rule ``--global-select calib`` uses for whole layers). ``layers:i,j,...`` keeps those layers
full and streams every head of the others (the per-layer choice, for comparison). KV bytes are the
formula's at the scored context.

    python benchmarks/streaming_heads_options.py --fractions 0.5 0.75 0.8333 --json runs/streaming_heads.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

BF16 = 2


@torch.no_grad()
def head_scores(model, ids: torch.Tensor, window: int, sinks: int) -> dict[str, torch.Tensor]:
    """Per layer and KV head ``[layers, kv_heads]``: mean attention mass of its query heads on keys
    outside sinks + window (``far``) and outside the window alone (``far_sinks``)."""
    cfg = model.config
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    far = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads)
    far_sinks = torch.zeros_like(far)
    for row in ids:
        attns = model(input_ids=row[None], use_cache=False, output_attentions=True).attentions
        t = row.numel()
        q = torch.arange(window, t)[:, None]
        k = torch.arange(t)[None, :]
        beyond = k <= q - window
        for i, a in enumerate(attns):
            p = a[0, :, window:].float()  # [heads, queries, keys]
            lost = (p * (beyond & (k >= sinks))).sum(-1).mean(-1)  # [heads]
            lost_all = (p * beyond).sum(-1).mean(-1)
            far[i] += lost.view(-1, rep).mean(-1) / len(ids)
            far_sinks[i] += lost_all.view(-1, rep).mean(-1) / len(ids)
    return {"far": far, "far_sinks": far_sinks}


def streaming_by_score(score: torch.Tensor, fraction: float) -> torch.Tensor:
    """Bool ``[layers, kv_heads]``: the ``fraction`` of heads with the lowest score stream."""
    n = round(fraction * score.numel())
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    mask[score.flatten().argsort()[:n]] = True
    return mask.view_as(score)


def streaming_by_layers(shape: tuple[int, int], full_layers: list[int]) -> torch.Tensor:
    mask = torch.ones(shape, dtype=torch.bool)
    mask[full_layers] = False
    return mask


def kv_bytes_per_token(streaming: torch.Tensor, head_dim: int, ctx: int, window: int, sinks: int) -> float:
    streamed = int(streaming.sum())
    full = streaming.numel() - streamed
    return 2 * head_dim * BF16 * (full * ctx + streamed * min(ctx, window + sinks)) / ctx


def install(state: dict) -> None:
    """Llama attention with a per-head mask: streaming heads see sinks + window only."""
    import transformers.models.llama.modeling_llama as llama

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        t = k.shape[2]
        pos = torch.arange(t)
        dist = pos[:, None] - pos[None, :]
        causal = dist >= 0
        local = causal & ((dist < state["window"]) | (pos[None, :] < state["sinks"]))
        heads = state["streaming"][self.layer_idx].repeat_interleave(rep)  # [H]
        allowed = torch.where(heads[:, None, None], local, causal)  # [H, T, T]
        scores = (q @ k.transpose(-1, -2)) * self.scaling
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), -1)
        out = p.to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    llama.LlamaAttention.forward = forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.75, 0.8333])
    ap.add_argument("--layers", nargs="*", default=["20,23,24,25,26"],
                    help="per-layer choices to compare: the full layers, comma separated")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from dev_slice import dev_model

    from foundation.calibration import CalibrationSpec, calibration_ids
    from foundation.perplexity import hf_logits_fn, perplexity

    path, ids, name, model = dev_model(args.tokens, attn_implementation="eager")
    calib = calibration_ids(path, CalibrationSpec(source="wikipedia:calib", num_samples=2, seq_len=1024))
    scores = head_scores(model, calib, args.window, args.sinks)
    shape = tuple(scores["far"].shape)
    runs = {"full": torch.zeros(shape, dtype=torch.bool)}
    for f in args.fractions:
        for rule, score in scores.items():
            runs[f"{rule} {f:g}"] = streaming_by_score(score, f)
    for layers in args.layers:
        runs[f"layers {layers}"] = streaming_by_layers(shape, [int(i) for i in layers.split(",")])
    state = {"window": args.window, "sinks": args.sinks}
    install(state)
    head_dim = model.config.head_dim
    base_bytes = kv_bytes_per_token(runs["full"], head_dim, args.ctx, args.window, args.sinks)
    results = {}
    for label, streaming in runs.items():
        state["streaming"] = streaming
        ppl = perplexity(hf_logits_fn(model), ids, name, context=args.ctx, stride=args.ctx // 2, progress=False).perplexity
        b = kv_bytes_per_token(streaming, head_dim, args.ctx, args.window, args.sinks)
        results[label] = {"ppl": ppl, "bytes_per_token": b, "streaming_heads": int(streaming.sum()),
                          "full_heads_by_layer": [int((~row).sum()) for row in streaming]}
        print(f"{label:24s} {int(streaming.sum()):3d} streaming  {b:8.0f} B/tok  {base_bytes / b:5.2f}x  ppl {ppl:.3f}",
              flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({"text": name, "ctx": args.ctx, "window": args.window,
                                                 "sinks": args.sinks, "calibration": "2 x 1024 tokens of wikipedia:calib",
                                                 "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
