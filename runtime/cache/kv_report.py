"""KV report: bytes per token per cache group (formula and allocator) and measured capacity.

For a config and a KV dtype: build the ``KVCacheSpec``, size the pools for a byte budget
(``KVCacheSpec.plan_num_blocks``), allocate the tensors for real, then admit ``seq_len``-token
sequences through the ``BlockManager`` (chunks of one block, sliding groups releasing what left
the window) until a block allocation fails. Capacity depends on the config only, so variants
(MQA, KV sharing, sliding layers, quantized KV) are built from the base config, no weights needed.
The one weight-side input is the scale mode of quantized KV, as the engine picks it: a checkpoint
with per-layer ``k_scale``/``v_scale`` stores no per-token scales (``static_scales``).

    python -m runtime.cache.kv_report --model smollm2 --budget-gib 1 --json runs/kv_report.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from foundation.attention_layout import (
    FULL,
    KV_SOURCE_KEY,
    SINKS_KEY,
    SLIDING,
    STREAMING_KEY,
    AttentionLayout,
)
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.kv_quant import QUANT_DTYPES
from runtime.cache.low_bit_kv import default_block_size
from runtime.engine.block_manager import BlockManager, PrefixHit

GIB = 1 << 30


@dataclass(frozen=True)
class GroupReport:
    kind: str
    window: int | None
    num_layers: int
    num_kv_heads: int
    kv_dtype: str
    num_blocks: int
    allocated_bytes: int  # counted from the tensors
    formula_bytes_per_token: float  # AttentionLayout.kv_bytes_per_token at seq_len, this group's layers
    counted_bytes_per_token: float  # bytes of the blocks one seq_len sequence holds / seq_len
    sinks: int = 0


@dataclass(frozen=True)
class VariantReport:
    name: str
    kv_dtype: str
    kv_scales: str  # "none", "per token and head" (dynamic) or "per layer" (checkpoint k_scale/v_scale)
    formula_bytes_per_token: float
    counted_bytes_per_token: float
    allocated_bytes: int
    capacity_seqs: int
    capacity_tokens: int
    groups: tuple[GroupReport, ...]
    block_size: int = 16
    residual_bytes_per_seq: int = 0  # int4/int2: the open block each running sequence keeps in bf16


def variant_configs(base: dict, window: int = 512, full_every: int = 6, short_window: int = 256,
                    sinks: int = 4) -> dict[str, tuple[dict, str]]:
    """The report's variants of ``base``: name -> (config, kv dtype). Hybrid keeps every
    ``full_every``-th layer full and slides the rest over ``window`` tokens (Gemma 3's pattern);
    the sinks variant slides over ``short_window`` tokens plus ``sinks`` attention sinks."""
    n = int(base["num_hidden_layers"])
    mqa = {"num_key_value_heads": 1}
    types = [FULL if i % full_every == full_every - 1 else SLIDING for i in range(n)]
    hybrid = {"sliding_window": window, "layer_types": types}
    with_sinks = {"sliding_window": short_window, "layer_types": types, SINKS_KEY: sinks}
    sinks_name = f"sliding {short_window} + {sinks} sinks, 1 in {full_every} full"
    kvh = int(base.get("num_key_value_heads") or base["num_attention_heads"])
    stream = list(range(kvh // 2, kvh))  # the upper half of each layer's KV heads stream
    streaming = {STREAMING_KEY: {"window": short_window, "sinks": sinks, "kv_heads": [stream] * n}}
    streaming_name = f"streaming heads ({len(stream)} of {kvh} per layer, {short_window} + {sinks} sinks)"
    share2 = {KV_SOURCE_KEY: share_pairs([FULL] * n)}
    combined = {**mqa, **hybrid, KV_SOURCE_KEY: share_pairs(types)}
    return {
        "original bf16": ({**base}, "bf16"),
        "MQA (1 KV head)": ({**base, **mqa}, "bf16"),
        "kv-share 2": ({**base, **share2}, "bf16"),
        f"hybrid (sliding {window}, 1 in {full_every} full)": ({**base, **hybrid}, "bf16"),
        "FP8 KV": ({**base}, "fp8_e4m3"),
        "INT8 KV": ({**base}, "int8"),
        "INT4 KV": ({**base}, "int4"),
        "K4V2 KV (4-bit keys, 2-bit values)": ({**base}, "k4v2"),
        "K3V2 KV (3-bit keys, 2-bit values)": ({**base}, "k3v2"),
        "INT2 KV": ({**base}, "int2"),
        "combined (MQA + share 2 + hybrid + FP8)": ({**base, **combined}, "fp8_e4m3"),
        "MQA + INT4": ({**base, **mqa}, "int4"),
        "kv-share 2 + INT4": ({**base, **share2}, "int4"),
        "hybrid + INT4": ({**base, **hybrid}, "int4"),
        "hybrid + INT2": ({**base, **hybrid}, "int2"),
        sinks_name: ({**base, **with_sinks}, "bf16"),
        f"{sinks_name} + INT4": ({**base, **with_sinks}, "int4"),
        streaming_name: ({**base, **streaming}, "bf16"),
        f"{streaming_name} + INT4": ({**base, **streaming}, "int4"),
        f"{streaming_name} + INT8 full / INT2 windowed": ({**base, **streaming}, "int8/int2"),
        "combined (MQA + share 2 + hybrid + INT4)": ({**base, **combined}, "int4"),
    }


def share_pairs(layer_types: list[str]) -> list[int]:
    """``kv_source_layers`` pairing each cache-owning layer with the next layer of the same kind."""
    sources: list[int] = []
    for i, t in enumerate(layer_types):
        pairs = i > 0 and sources[i - 1] == i - 1 and layer_types[i - 1] == t
        sources.append(i - 1 if pairs else i)
    return sources


def measure_capacity(spec: KVCacheSpec, num_blocks: tuple[int, ...], seq_len: int) -> tuple[int, list[int]]:
    """Admit ``seq_len``-token sequences until a block allocation fails.

    Returns (sequences held, blocks one full sequence holds per group)."""
    bm = BlockManager(num_blocks, spec.block_size, spec.windows, enable_prefix_caching=False, sinks=spec.sinks)
    bs = spec.block_size
    held, per_seq = 0, None
    empty = PrefixHit(0, tuple(() for _ in num_blocks), ())
    while True:
        if not bm.allocate(held, empty, bs):
            return held, per_seq or [0] * len(num_blocks)
        done = bs
        while done < seq_len:
            bm.release_window(held, done)
            if not bm.append(held, done, min(done + bs, seq_len)):
                return held, per_seq or [0] * len(num_blocks)
            done = min(done + bs, seq_len)
        bm.release_window(held, seq_len)
        if per_seq is None:
            per_seq = [sum(1 for b in t if b >= 0) for t in bm.block_tables(held)]
        held += 1


def has_static_kv_scales(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` carries per-layer KV scales for every cache owner (then
    the engine quantizes KV with them and allocates no per-token scales)."""
    from foundation.checkpoint import Checkpoint
    from runtime.engine.engine import kv_layer_scales

    ckpt = Checkpoint.open(path)
    return kv_layer_scales(ckpt, AttentionLayout.from_config(ckpt.config).cache_owners()) is not None


def report_variant(name: str, config: dict, kv_dtype: str, budget_bytes: int, seq_len: int = 2048,
                   block_size: int | None = None, static_scales: bool = False) -> VariantReport:
    """``block_size``: None for the engine's default for ``kv_dtype``. ``static_scales``: quantized KV uses per-layer checkpoint scales (no per-token scale bytes),
    as the engine does for a checkpoint with ``k_scale``/``v_scale``; no effect on unquantized KV."""
    layout = AttentionLayout.from_config(config)
    static = static_scales and kv_dtype in QUANT_DTYPES
    block_size = block_size or default_block_size(kv_dtype)
    spec = KVCacheSpec.from_layout(layout, kv_dtype, block_size, static_scales=static)
    num_blocks = spec.plan_num_blocks(budget_bytes, seq_len)
    layer_scales = {i: (1.0, 1.0) for i in layout.cache_owners()} if static else None  # values do not matter here
    residual = spec.residual_blocks_per_seq  # allocated apart; the open block is per running sequence, not per token
    cache = KVCache(spec, num_blocks, layer_scales=layer_scales, residual_blocks=residual,
                    residual_dtype=torch.bfloat16)  # real allocation: the bytes below are counted from it
    seqs, per_seq = measure_capacity(spec, num_blocks, seq_len)
    groups = []
    residual_bytes = sum(spec.residual_block_bytes(g, torch.bfloat16) for g in range(len(spec.groups)))
    for g, grp in enumerate(spec.groups):
        nbytes = cache.group_nbytes(g) - residual * spec.residual_block_bytes(g, torch.bfloat16)
        slot_bytes = nbytes / (num_blocks[g] * block_size) if num_blocks[g] else 0.0
        exact = spec.exact_block_bytes(g) / seq_len  # a first block kept exact: per stored sequence
        formula = layout.kv_bytes_per_token(seq_len, spec.element_bytes(g), spec.scale_bytes(grp), list(grp.layers))
        groups.append(GroupReport(grp.kind, grp.window, len(grp.layers), grp.num_kv_heads, grp.kv_dtype,
                                  num_blocks[g], nbytes, formula + exact,
                                  slot_bytes * per_seq[g] * block_size / seq_len + exact, grp.sinks))
    del cache
    return VariantReport(
        name=name,
        kv_dtype=kv_dtype,
        kv_scales=_scales(spec, static),
        formula_bytes_per_token=sum(g.formula_bytes_per_token for g in groups),
        counted_bytes_per_token=sum(g.counted_bytes_per_token for g in groups),
        allocated_bytes=sum(g.allocated_bytes for g in groups),
        capacity_seqs=seqs,
        capacity_tokens=seqs * seq_len,
        groups=tuple(groups),
        block_size=block_size,
        residual_bytes_per_seq=residual_bytes,
    )


def _scales(spec: KVCacheSpec, static: bool) -> str:
    if static:
        return "per layer"
    kinds = dict.fromkeys("K/channel, V/token" if g.bits else "per token and head" if g.quantized else "none"
                          for g in spec.groups)
    return " + ".join(kinds)


def format_table(reports: list[VariantReport], budget_bytes: int, seq_len: int) -> str:
    base = reports[0]
    lines = [
        f"KV cache, {budget_bytes / GIB:g} GiB budget, {seq_len}-token sequences",
        f"{'variant':44s} {'KV':9s} {'scales':18s} {'B/tok formula':>13s} {'B/tok counted':>13s} {'groups':>6s} "
        f"{'allocated MiB':>13s} {'seqs':>5s} {'vs orig':>7s}",
    ]
    for r in reports:
        lines.append(
            f"{r.name:44s} {r.kv_dtype:9s} {r.kv_scales:18s} {r.formula_bytes_per_token:13.0f} {r.counted_bytes_per_token:13.0f} "
            f"{len(r.groups):6d} {r.allocated_bytes / 2**20:13.1f} {r.capacity_seqs:5d} "
            f"{r.capacity_seqs / max(base.capacity_seqs, 1):6.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from foundation.model_source import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block (default: 16; packed int4/k4v2/k3v2/int2: 64)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model_dir = resolve_model(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    static = has_static_kv_scales(model_dir)
    budget = int(args.budget_gib * GIB)
    reports = [report_variant(name, cfg, dt, budget, args.seq_len, args.block_size, static)
               for name, (cfg, dt) in variant_configs(config).items()]
    print(format_table(reports, budget, args.seq_len))
    for r in reports:
        if r.residual_bytes_per_seq:
            print(f"  {r.name}: blocks of {r.block_size} tokens; each running sequence also keeps its open block "
                  f"in bf16 ({r.residual_bytes_per_seq / 1024:.0f} KiB, not in B/tok)")
    for r in reports:
        for g in r.groups:
            window = "" if g.window is None else f"/{g.window}" + (f"+{g.sinks} sinks" if g.sinks else "")
            print(f"  {r.name}: {g.kind}{window} x{g.num_layers} entries in {g.kv_dtype}, "
                  f"{g.num_kv_heads} KV heads: {g.formula_bytes_per_token:.0f} B/tok formula, "
                  f"{g.counted_bytes_per_token:.0f} counted, {g.num_blocks} blocks")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
