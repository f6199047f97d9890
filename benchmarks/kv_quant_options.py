"""int4/int2 KV options simulated in the transformers model, on the dev slice (never evaluation text).

Each attention layer fake-quantizes K and V the way the paged cache stores them (keys per channel
over each 64-token block, values per token and head, asymmetric, fp16 scale and minimum) and reads
them as a decoded token does: earlier blocks quantized, its own block exact. Options:
``pre_rope`` (keys quantized before RoPE, rotated after), ``k_rot`` / ``v_rot`` (a random-sign
Hadamard rotation per head before quantizing, undone after), ``clip`` (per-group range shrink
about its centre, minimizing squared error; a number: the smallest shrink tried, default 0.5),
``outliers`` (dense-and-sparse: that fraction of each group, furthest from its median, kept
exact), ``levels: "normal"`` (2-bit codes at mean + std x a normal's Lloyd-Max levels),
``k_clip`` / ``v_clip`` / ``k_outliers`` / ``v_outliers`` (for keys or values alone), ``v_group`` (value groups along head_dim), ``k_bits`` / ``v_bits``,
``sym`` (symmetric codes about zero: a scale and no minimum), ``exact_first`` (the first block, which
holds the attention-sink tokens, kept exact), ``exact_sinks`` N (the first N tokens kept exact and out
of their block's key ranges), ``block`` (tokens per key group and exact open block; default 64).
It ranks options cheaply; the served figures come from ``engine_kv_perplexity.py``.

    python benchmarks/kv_quant_options.py --tokens 4096 --ctx 2048 '{"bits": 2}' '{"bits": 2, "pre_rope": true}'
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from runtime.cache.kv_rotation import randomized_hadamard  # the served int2 values' basis

BLOCK = 64
LEVEL_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
GAUSS_2BIT = (-1.510, -0.4528, 0.4528, 1.510)  # Lloyd-Max levels of a unit normal at 2 bits


def fake_quantize_normal(x: torch.Tensor, dim: int, search: bool) -> torch.Tensor:
    """2-bit codes at a group's mean + std * the normal's Lloyd-Max levels (an fp16 mean and std
    per group: the bytes of a scale and minimum); ``search``: the std scaled by the factor of
    least squared error."""
    mu, sd = x.mean(dim, keepdim=True).half().float(), x.std(dim, keepdim=True).clamp_min(1e-6).half().float()
    lv = torch.tensor(GAUSS_2BIT)
    best, best_err = None, None
    for r in ((0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5) if search else (1.0,)):
        z = (x - mu) / (sd * r)
        y = mu + sd * r * lv[(z.unsqueeze(-1) - lv).abs().argmin(-1)]
        err = ((y - x) ** 2).sum(dim, keepdim=True)
        if best is None:
            best, best_err = y, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, y, best), torch.where(better, err, best_err)
    return best


def with_outliers(x: torch.Tensor, dim: int, frac: float, quantize) -> torch.Tensor:
    """Dense-and-sparse: the ``frac`` of each group's elements furthest from its median kept exact,
    the rest quantized over their own range."""
    n = x.shape[dim]
    k = max(1, round(frac * n))
    med = x.median(dim, keepdim=True).values
    dev = (x - med).abs()
    out = dev >= dev.topk(k, dim).values.narrow(dim, k - 1, 1)
    inner = torch.where(out, med, x)  # outliers neither widen nor join the range
    return torch.where(out, x, quantize(inner))


def fake_quantize(x: torch.Tensor, dim: int, bits: int, clip: bool | float, sym: bool = False) -> torch.Tensor:
    """Round-to-nearest with one fp16 (scale, minimum) per slice along ``dim``; ``sym``: the
    range centred on zero, so the minimum is ``-levels / 2 * scale`` and needs no storage."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if sym:
        hi = torch.maximum(hi.abs(), lo.abs())
        lo = -hi

    def rtn(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        scale = ((hi - lo) / levels).clamp_min(1e-6).half().float()
        lo16 = lo.half().float()
        return torch.round((x - lo16) / scale).clamp(0, levels) * scale + lo16

    best = rtn(lo, hi)
    if clip:
        best_err = ((best - x) ** 2).sum(dim, keepdim=True)
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        # clip a float: the smallest shrink tried, in steps of 0.05
        shrinks = LEVEL_SHRINK if clip is True else [1 - 0.05 * i for i in range(round((1 - clip) / 0.05) + 1)]
        for r in shrinks[1:]:
            y = rtn(mid - half * r, mid + half * r)
            err = ((y - x) ** 2).sum(dim, keepdim=True)
            better = err < best_err
            best, best_err = torch.where(better, y, best), torch.where(better, err, best_err)
    return best


class Options:
    def __init__(self, spec: dict, head_dim: int):
        self.spec = spec
        self.bits = int(spec["bits"])
        self.block = int(spec.get("block", BLOCK))  # key group and exact open block, in tokens
        self.rot = randomized_hadamard(head_dim)

    def quantize(self, x: torch.Tensor, dim: int, bits: int, part: str) -> torch.Tensor:
        """``part`` "k" or "v": ``k_clip`` / ``v_outliers`` etc. override ``clip`` / ``outliers``."""
        spec = self.spec
        clip = spec.get(f"{part}_clip", spec.get("clip", False))
        if spec.get("levels") == "normal" and bits == 2:
            def one(y: torch.Tensor) -> torch.Tensor:
                return fake_quantize_normal(y, dim, clip)
        else:
            def one(y: torch.Tensor) -> torch.Tensor:
                return fake_quantize(y, dim, bits, clip, spec.get("sym", False))
        frac = spec.get(f"{part}_outliers", spec.get("outliers", 0))
        return with_outliers(x, dim, frac, one) if frac else one(x)

    def keys(self, k: torch.Tensor) -> torch.Tensor:  # [B, KVH, T, D], T a multiple of the block
        b, h, t, d = k.shape
        rot = self.spec.get("k_rot")
        x = k @ self.rot if rot else k
        n = self.spec.get("exact_sinks", 0)
        if n:  # read exact elsewhere; here they only must not widen block 0's ranges
            x = torch.cat([x[:, :, n:n + 1].expand(-1, -1, n, -1), x[:, :, n:]], dim=2)
        y = self.quantize(x.reshape(b, h, t // self.block, self.block, d), 3, self.spec.get("k_bits", self.bits), "k").reshape(b, h, t, d)
        return y @ self.rot.T if rot else y

    def values(self, v: torch.Tensor) -> torch.Tensor:
        b, h, t, d = v.shape
        rot, g = self.spec.get("v_rot"), self.spec.get("v_group", d)
        x = v @ self.rot if rot else v
        y = self.quantize(x.reshape(b, h, t, d // g, g), -1, self.spec.get("v_bits", self.bits), "v").reshape(b, h, t, d)
        return y @ self.rot.T if rot else y


def install(options_ref: list) -> None:
    """Replace Llama attention's forward with one that reads K/V as the options store them."""
    import transformers.models.llama.modeling_llama as llama

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        opt: Options = options_ref[0]
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        t = k.shape[2]
        pad = (-t) % opt.block

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, 0, 0, pad))

        if opt.bits and opt.spec.get("pre_rope"):
            kq = opt.keys(padded(k))[:, :, :t]
            q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
            _, kq = llama.apply_rotary_pos_emb(q, kq, cos, sin)
        else:
            q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
            kq = opt.keys(padded(k))[:, :, :t] if opt.bits else k
        vq = opt.values(padded(v))[:, :, :t] if opt.bits else v
        rep = q.shape[1] // k.shape[1]
        k, v, kq, vq = (x.repeat_interleave(rep, 1) for x in (k, v, kq, vq))
        pos = torch.arange(t)
        causal = pos[None, :] <= pos[:, None]
        earlier = (pos[None, :] // opt.block) < (pos[:, None] // opt.block)  # key in an earlier block
        if opt.spec.get("exact_first"):
            earlier &= pos[None, :] >= opt.block
        earlier &= pos[None, :] >= opt.spec.get("exact_sinks", 0)
        scores = torch.where(earlier, q @ kq.transpose(-1, -2), q @ k.transpose(-1, -2)) * self.scaling
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")).float(), -1)
        out = (p * earlier) @ vq + (p * ~earlier) @ v
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    llama.LlamaAttention.forward = forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("options", nargs="+", help='JSON per run, e.g. \'{"bits": 2, "pre_rope": true}\' ({"bits": 0}: exact)')
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from dev_slice import dev_model

    from foundation.perplexity import hf_logits_fn, perplexity

    _, ids, name, model = dev_model(args.tokens)
    current: list = [None]
    install(current)
    results = {}
    for raw in args.options:
        current[0] = Options(json.loads(raw), model.config.head_dim)
        r = perplexity(hf_logits_fn(model), ids, name, context=args.ctx, stride=args.ctx // 2)
        results[raw] = r.perplexity
        print(f"{r.perplexity:8.3f}  {raw}  ({r.describe()})", flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({"text": name, "ctx": args.ctx, "perplexity": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
