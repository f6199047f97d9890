"""Paged attention over bf16 / FP8 / INT8 KV caches: decode bandwidth and prefill throughput.

Decode: for each head layout, KV dtype, batch and context length, times one attention step
(CUDA-graph replay) of the Triton kernel, computes the KV bytes it must read (K and V rows,
plus per-token scales), and reports GB/s as a fraction of the measured copy bandwidth, next to
torch's ``scaled_dot_product_attention`` on the same context stored dense and unpaged in bf16
(the speed a paged, quantized cache has to stay close to). Prefill: causal attention over
whole prompts, TFLOP/s against the same SDPA baseline. Outputs are checked against the
plain-torch reference first.

    python benchmarks/paged_attention_bench.py [--out benchmarks/results/paged_attention.json]

Needs a CUDA GPU; without one it prints one line and exits 2. ``--smoke`` runs tiny shapes on
the CPU through the Triton interpreter to check the script itself (timings mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

# (name, heads, kv heads, head dim)
HEAD_LAYOUTS = [("smollm2-135m", 9, 3, 64), ("llama-8b-sized", 32, 8, 128), ("mqa-d128", 32, 1, 128)]
KV_TYPES = ["bf16", "fp8/token", "int8/token", "fp8/layer"]
BATCHES = [1, 16, 64]
CONTEXTS = [512, 4096]
BLOCK_SIZE = 16
MAX_ERR = 2e-2  # fixed before measuring: bf16 output vs the fp32 reference, absolute


def kv_setup(kv: str, torch):
    """(cache dtype, scales kind) for a KV type name."""
    return {"bf16": (torch.bfloat16, None), "fp8/token": (torch.float8_e4m3fn, "token"),
            "int8/token": (torch.int8, "token"), "fp8/layer": (torch.float8_e4m3fn, "layer")}[kv]


def make_batch(B, ctx, q_len, H, KVH, D, kv, device, q_dtype, torch):
    """A batch of B sequences of ``ctx`` cached tokens (blocks shuffled), ``q_len`` new each,
    written through the Triton store (CUDA) or the reference store (smoke)."""
    from runtime.kernels import kv_store as kvs

    dtype, scales = kv_setup(kv, torch)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = B * blocks_per_seq
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, KVH, D, dtype=dtype, device=device)
    v_cache = torch.empty_like(k_cache)
    k_scale = v_scale = None
    if scales == "token":
        k_scale = torch.empty(num_blocks, BLOCK_SIZE, KVH, device=device)
        v_scale = torch.empty_like(k_scale)
    elif scales == "layer":
        k_scale, v_scale = torch.tensor(4.0 / 448, device=device), torch.tensor(4.0 / 448, device=device)
    block_tables = torch.randperm(num_blocks, device=device).int().reshape(B, blocks_per_seq)
    pos = torch.arange(ctx, device=device)
    slots = (block_tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    k = torch.randn(B * ctx, KVH, D, device=device, dtype=q_dtype)
    v = torch.randn(B * ctx, KVH, D, device=device, dtype=q_dtype)
    store = kvs.store_kv if torch.device(device).type == "cuda" else kvs.reference_store_kv
    store(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    q = torch.randn(B * q_len, H, D, device=device, dtype=q_dtype)
    context_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32, device=device)
    dense_k = k.reshape(B, ctx, KVH, D).transpose(1, 2).contiguous()  # the unpaged bf16 baseline
    dense_v = v.reshape(B, ctx, KVH, D).transpose(1, 2).contiguous()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale, block_tables=block_tables,
                context_lens=context_lens, query_start_loc=qsl, dense_k=dense_k, dense_v=dense_v)


def kv_bytes(b: dict, B: int, ctx: int) -> int:
    """Bytes of cached K/V (and their per-token scales) one step reads."""
    kc = b["k_cache"]
    row = kc.shape[2] * kc.shape[3] * kc.element_size()
    scale = kc.shape[2] * 4 if b["k_scale"] is not None and b["k_scale"].dim() == 3 else 0
    return 2 * B * ctx * (row + scale)


class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def ms(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="paged attention over quantized KV caches")
    parser.add_argument("--kv", default=",".join(KV_TYPES))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/paged_attention.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU via the Triton interpreter (checks the script only)")
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("paged_attention_bench: no CUDA GPU visible (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton

    from runtime.kernels import paged_attention as pa

    torch.set_num_threads(2)
    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    q_dtype = torch.bfloat16 if cuda else torch.float32
    layouts, kvs = HEAD_LAYOUTS, args.kv.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    prefill_len = args.prefill_len
    if args.smoke:
        layouts, batches, contexts, prefill_len = [("smoke", 4, 2, 16)], [2], [40], 24
    timer = Timer(cuda)
    copy_gbps = None
    if cuda:
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / timer.ms(lambda: dst.copy_(src)) / 1e6
        del src, dst
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (smoke, interpreter)'}; measured copy {copy_gbps or 0:.0f} GB/s; block size {BLOCK_SIZE}")

    rows = []
    print(f"{'phase':<8} {'layout':<15} {'kv':<11} {'B':>4} {'ctx':>6} {'paged us':>9} {'sdpa us':>9} {'KV GB/s':>8} {'%BW':>5} {'TFLOP/s':>8} {'vs sdpa':>8} {'max err':>9}")
    for name, H, KVH, D in layouts:
        for kv in kvs:
            for phase, B, ctx in [("decode", B, c) for B in batches for c in contexts] + [("prefill", 4, prefill_len)]:
                q_len = 1 if phase == "decode" else ctx
                if cuda and B * ctx * KVH * D * 2 * 4 > 16 * 2**30:  # skip batches past ~16 GiB of fp32 inputs
                    continue
                b = make_batch(B, ctx, q_len, H, KVH, D, kv, device, q_dtype, torch)
                kw = dict(scale=D ** -0.5, k_scale=b["k_scale"], v_scale=b["v_scale"])
                paged_args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"], b["query_start_loc"])
                run = lambda: pa.paged_attention(*paged_args, max_query_len=q_len, max_context_len=ctx, **kw)
                out = run().float()
                if B * q_len <= 8192:  # the reference loops over sequences in Python; check a bounded amount
                    ref = pa.reference_paged_attention(*paged_args, **kw).float()
                    err = (out - ref).abs().max().item()
                else:
                    err = None
                qd = b["q"].reshape(B, q_len, H, D).transpose(1, 2)
                sdpa = lambda k=b["dense_k"], v=b["dense_v"]: F.scaled_dot_product_attention(
                    qd, k, v, is_causal=phase == "prefill", scale=D ** -0.5, enable_gqa=True)
                paged_ms, sdpa_ms = timer.ms(run), timer.ms(sdpa)
                moved = kv_bytes(b, B, ctx)
                flops = 4 * B * H * D * (q_len * ctx if phase == "decode" else ctx * (ctx + 1) // 2)
                row = dict(phase=phase, layout=name, heads=H, kv_heads=KVH, head_dim=D, kv=kv, batch=B, context=ctx,
                           paged_us=paged_ms * 1e3, sdpa_bf16_us=sdpa_ms * 1e3, kv_bytes=moved, kv_gbps=moved / paged_ms / 1e6,
                           frac_bandwidth=(moved / paged_ms / 1e6) / copy_gbps if copy_gbps else None,
                           tflops=flops / paged_ms / 1e9, speedup_vs_sdpa=sdpa_ms / paged_ms, max_abs_err=err,
                           ok=err is None or err <= MAX_ERR)
                rows.append(row)
                pct = "-" if row["frac_bandwidth"] is None else f"{100 * row['frac_bandwidth']:.0f}"
                print(f"{phase:<8} {name:<15} {kv:<11} {B:>4} {ctx:>6} {paged_ms * 1e3:>9.1f} {sdpa_ms * 1e3:>9.1f} "
                      f"{row['kv_gbps']:>8.0f} {pct:>5} {row['tflops']:>8.2f} {row['speedup_vs_sdpa']:>7.2f}x "
                      f"{'-' if err is None else format(err, '9.1e'):>9}{'' if row['ok'] else '  FAIL'}", flush=True)
                del b

    result = {
        "benchmark": "paged_attention",
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke: Triton interpreter, timings meaningless)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "timing": "median us of CUDA-graph replay (triton do_bench_cudagraph)", "block_size": BLOCK_SIZE,
        "baseline": "torch scaled_dot_product_attention, dense unpaged bf16 K/V, enable_gqa", "copy_gbps": copy_gbps,
        "max_err_threshold": MAX_ERR, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
