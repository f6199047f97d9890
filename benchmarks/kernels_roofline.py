"""Dequant-matmul kernels against the memory/compute roofline of the GPU they run on.

For each linear shape (N out, K in), batch M and weight scheme, times the kernel (CUDA-graph
replay, and eager launches), computes the bytes it must move (packed weight + scales + zero
points + g_idx + activations + output) and its FLOPs, and reports achieved GB/s and TFLOP/s as
fractions of the *measured* device peaks (device-to-device copy bandwidth, large bf16 cuBLAS
matmul). Every kernel's output is checked against its plain-torch reference first.

    python benchmarks/kernels_roofline.py [--model smollm2] [--out benchmarks/results/kernels_roofline.json]

Needs a CUDA GPU (Hopper for FP8 W8A8); without one it prints one line and exits 2.
``--smoke`` runs tiny shapes on the CPU through the Triton interpreter to check the script
itself (its timings mean nothing).
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

# Linear shapes (name, N, K) per model; override with --model to read a checkpoint's config.
SHAPE_SETS = {
    # SmolLM2-135M (the default model): hidden 576, 9 heads x 64, 3 KV heads, MLP 1536
    "smollm2-135m": [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536)],
    # a Llama-3-8B-sized layer: hidden 4096, 32 heads x 128, 8 KV heads, MLP 14336
    "llama-8b-sized": [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)],
}
# w4a16-g128 schemes use group 64 where 128 does not divide K (see int4_group)
SCHEMES = ["bf16", "w4a16-g128", "w4a16-g128-asym", "w4a16-g128-actorder", "w8a16", "fp8-w8a16", "fp8-w8a8"]
BATCHES = [1, 16, 256, 2048]
GRAPH_MAX_M = 16  # CUDA-graph timing for decode-sized batches; eager timing covers the rest
MAX_REL_ERR = 2e-2  # fixed before measuring: max |kernel - reference| / max |reference| (bf16 output)


def shapes_from_model(name: str) -> list[tuple[str, int, int]]:
    from foundation.checkpoint import Checkpoint
    from foundation.model_source import resolve_model

    cfg = Checkpoint.open(resolve_model(name)).config
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    inter = cfg["intermediate_size"]
    return [("qkv_proj", (heads + 2 * kv) * d, h), ("o_proj", h, heads * d), ("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)]


def int4_group(K: int) -> int:
    """128, or 64 where 128 does not divide K (SmolLM2's 576-wide inputs)."""
    return 128 if K % 128 == 0 else 64


def make_weight(scheme: str, N: int, K: int, device, dense_dtype, torch):
    """(tensors, bytes of the stored weight) for one scheme, random but well-formed."""
    g = torch.Generator(device="cpu").manual_seed(N * 7 + K)
    if scheme == "bf16":  # the unquantized baseline, in the activation dtype (bf16 on GPU)
        w = (torch.randn(N, K, generator=g) * 0.02).to(dense_dtype)
        return {"weight": w.to(device)}, w.numel() * w.element_size()
    if scheme.startswith("fp8"):
        w = torch.randn(N, K, generator=g)
        s = w.abs().amax(dim=1, keepdim=True) / 448
        t = {"weight": (w / s).to(torch.float8_e4m3fn).to(device), "weight_scale": s.to(device)}
        return t, N * K + N * 4
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    bits = 4 if scheme.startswith("w4") else 8
    group = int4_group(K) if bits == 4 else K
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (N, K), generator=g, dtype=torch.int8)
    t = {"weight_packed": pack_to_int32(q, bits), "weight_scale": (torch.rand(N, K // group, generator=g) * 0.01).to(torch.bfloat16)}
    if scheme.endswith("asym"):
        t["weight_zero_point"] = pack_to_int32(torch.randint(-half, half, (N, K // group), generator=g, dtype=torch.int8), bits, packed_dim=0)
    if scheme.endswith("actorder"):
        t["weight_g_idx"] = (torch.randperm(K, generator=g) // group).to(torch.int32)
    t = {k: v.to(device) for k, v in t.items()}
    return t, sum(v.numel() * v.element_size() for v in t.values())


def kernel_and_reference(scheme: str, t: dict, dm, F):
    if scheme == "bf16":
        fn = lambda x: F.linear(x, t["weight"])
        return fn, fn
    if scheme == "fp8-w8a16":
        return (lambda x: dm.fp8_weight_matmul(x, t["weight"], t["weight_scale"]),
                lambda x: dm.reference_fp8_weight_matmul(x, t["weight"], t["weight_scale"]))
    if scheme == "fp8-w8a8":
        return (lambda x: dm.fp8_w8a8_matmul(x, t["weight"], t["weight_scale"]),
                lambda x: dm.reference_fp8_w8a8_matmul(x, t["weight"], t["weight_scale"]))
    bits = 4 if scheme.startswith("w4") else 8
    args = (t["weight_packed"], t["weight_scale"], bits, t.get("weight_zero_point"), t.get("weight_g_idx"))
    return (lambda x: dm.int_weight_matmul(x, *args)), (lambda x: dm.reference_int_weight_matmul(x, *args))


class Timer:
    """CUDA: medians of triton's do_bench (eager launches) and do_bench_cudagraph (replay, for
    small M where launch overhead would hide the kernel); smoke: wall clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def eager_ms(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=50, return_mode="median"))

    def graph_ms(self, fn) -> float | None:
        if not self.cuda:
            return None
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def measure_peaks(torch, timer: Timer) -> dict:
    """Measured copy bandwidth (GB/s) and bf16 dense matmul throughput (TFLOP/s)."""
    if not timer.cuda:
        return {"copy_gbps": None, "bf16_tflops": None}
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.eager_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = timer.eager_ms(lambda: a @ a)
    return {"copy_gbps": 2 * src.numel() / ms / 1e6, "bf16_tflops": 2 * 8192**3 / mm_ms / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="dequant-matmul kernels vs the GPU roofline")
    parser.add_argument("--model", help="read linear shapes from this checkpoint's config (name or dir) instead of the built-in sets")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--batches", help=f"comma-separated M values (default {','.join(map(str, BATCHES))}; smoke 1,20)")
    parser.add_argument("--out", default="benchmarks/results/kernels_roofline.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU via the Triton interpreter (checks the script only)")
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("kernels_roofline: no CUDA GPU visible (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton

    from runtime.kernels import dequant_matmul as dm

    torch.set_num_threads(2)
    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    act_dtype = torch.bfloat16 if cuda else torch.float32
    schemes = args.schemes.split(",")
    batches = [int(b) for b in (args.batches or ",".join(map(str, [1, 20] if args.smoke else BATCHES))).split(",")]
    if args.smoke:
        shape_sets = {"smoke": [("tiny", 64, 192)]}  # 192: the g128 schemes fall back to g64
        schemes = [s for s in schemes if s != "fp8-w8a8"]  # _scaled_mm needs Hopper
    elif args.model:
        shape_sets = {args.model: shapes_from_model(args.model)}
    else:
        shape_sets = SHAPE_SETS
    hopper = cuda and torch.cuda.get_device_capability() >= (8, 9)
    timer = Timer(cuda)
    peaks = measure_peaks(torch, timer)

    rows = []
    header = f"{'model':<15} {'layer':<13} {'N':>6} {'K':>6} {'M':>5} {'scheme':<20} {'graph us':>9} {'eager us':>9} {'GB/s':>7} {'%BW':>5} {'TFLOP/s':>8} {'%roof':>6} {'max rel err':>11}"
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (smoke, interpreter)'}; "
          f"measured copy {peaks['copy_gbps'] or 0:.0f} GB/s, bf16 matmul {peaks['bf16_tflops'] or 0:.0f} TFLOP/s")
    print(header)
    for model, shapes in shape_sets.items():
        for layer, N, K in shapes:
            for scheme in schemes:
                if scheme == "fp8-w8a8" and not hopper:
                    continue
                t, weight_bytes = make_weight(scheme, N, K, device, act_dtype, torch)
                kernel, reference = kernel_and_reference(scheme, t, dm, F)
                for M in batches:
                    x = torch.randn(M, K, device=device, dtype=act_dtype)
                    y, ref = kernel(x).float(), reference(x).float()
                    err = ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                    graph = timer.graph_ms(lambda: kernel(x)) if M <= GRAPH_MAX_M else None
                    eager = timer.eager_ms(lambda: kernel(x))
                    ms = graph if graph is not None else eager
                    moved = weight_bytes + x.numel() * x.element_size() + M * N * x.element_size()
                    flops = 2 * M * N * K
                    gbps, tflops = moved / ms / 1e6, flops / ms / 1e9
                    roof_ms = None
                    if peaks["copy_gbps"]:
                        roof_ms = max(moved / peaks["copy_gbps"] / 1e6, flops / peaks["bf16_tflops"] / 1e9)
                    row = dict(model=model, layer=layer, N=N, K=K, M=M, scheme=scheme,
                               group=int4_group(K) if scheme.startswith("w4") else None, graph_us=None if graph is None else graph * 1e3,
                               eager_us=eager * 1e3, bytes=moved, flops=flops, gbps=gbps, tflops=tflops,
                               frac_bandwidth=gbps / peaks["copy_gbps"] if peaks["copy_gbps"] else None,
                               frac_roofline=roof_ms / ms if roof_ms else None, max_rel_err=err, ok=err <= MAX_REL_ERR)
                    rows.append(row)
                    fmt = lambda v, spec: "-" if v is None else format(v, spec)
                    print(f"{model:<15} {layer:<13} {N:>6} {K:>6} {M:>5} {scheme:<20} {fmt(row['graph_us'], '9.1f'):>9} "
                          f"{row['eager_us']:>9.1f} {gbps:>7.0f} {fmt(row['frac_bandwidth'] and 100 * row['frac_bandwidth'], '5.0f'):>5} "
                          f"{tflops:>8.2f} {fmt(row['frac_roofline'] and 100 * row['frac_roofline'], '6.0f'):>6} {err:>11.2e}{'' if row['ok'] else '  FAIL'}", flush=True)

    result = {
        "benchmark": "kernels_roofline",
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke: Triton interpreter, timings meaningless)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "activation_dtype": str(act_dtype), "timing": f"median us; graph = CUDA-graph replay (triton do_bench_cudagraph, M <= {GRAPH_MAX_M}), eager = do_bench; throughput uses graph when present",
        "bytes": "stored weight tensors + activations + output", "peaks": peaks,
        "max_rel_err_threshold": MAX_REL_ERR, "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
