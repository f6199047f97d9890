"""One layer's K/V read for a decode step on the CPU: bf16 blocks gathered against packed blocks
dequantized eagerly and by the compiled read (``runtime.cache.compiled_kv_read``).

The default model's 3 KV heads of 64, ``--seqs`` sequences of ``--context`` tokens whose blocks lie
scattered over the cache; bf16 in 16-token blocks (``gather_blocks``, what the engine's bf16 cache
reads), packed dtypes in 64-token blocks, read into bf16. Every compiled read is checked against the
eager one first (max |diff| <= one bf16 rounding). Milliseconds per layer read, K and V:

    python benchmarks/cpu_kv_read.py --json benchmarks/results/cpu_kv_read.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import torch  # noqa: E402

KV_HEADS, HEAD_DIM, BF16_BLOCK, PACKED_BLOCK = 3, 64, 16, 64


def _table(seqs: int, blocks_each: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    num_blocks = 2 * seqs * blocks_each
    return torch.randperm(num_blocks, generator=g)[:seqs * blocks_each].view(seqs, blocks_each), num_blocks


def case(seqs: int, context: int, reps: int, dtypes: list[str]) -> dict:
    from runtime.cache.low_bit_kv import LOW_BIT_KV, packed_dim
    from runtime.cache.compiled_kv_read import _packed_keys, _packed_values, read_packed_keys, read_packed_values
    from runtime.cache.paged_rows import gather_blocks

    from cpu_paged_decode_attention import ms  # a sibling script

    g = torch.Generator().manual_seed(seqs)
    dt = torch.bfloat16
    table, n = _table(seqs, -(-context // BF16_BLOCK), g)
    k_cache = torch.randn(n, BF16_BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dt)
    v_cache = torch.randn(n, BF16_BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dt)
    def bf16():
        return gather_blocks(k_cache, None, table, dt), gather_blocks(v_cache, None, table, dt)

    rows = {"bf16, gathered": ms(bf16, reps)}
    table, n = _table(seqs, -(-context // PACKED_BLOCK), g)
    flat = table.reshape(-1)
    for name in dtypes:
        bits = LOW_BIT_KV[name]
        kc, vc = (torch.randint(0, 256, (n, PACKED_BLOCK, KV_HEADS, packed_dim(HEAD_DIM, b)), dtype=torch.uint8,
                                generator=g) for b in (bits.keys, bits.values))
        ks, km = (torch.rand(n, KV_HEADS, HEAD_DIM, generator=g).half() for _ in range(2))
        vs, vm = (torch.rand(n, PACKED_BLOCK, KV_HEADS, generator=g).half() for _ in range(2))

        def eager():
            return _packed_keys(kc, ks, km, flat, bits.keys, dt), _packed_values(vc, vs, vm, flat, bits.values, dt)

        def compiled():
            return (read_packed_keys(kc, ks, km, flat, bits.keys, dt),
                    read_packed_values(vc, vs, vm, flat, bits.values, dt))

        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(compiled(), eager()))
        if read_packed_keys.failed or read_packed_values.failed:
            raise SystemExit("the compiled read fell back to eager: nothing compiled to measure")
        if err > 2 ** -7 * 8:  # one bf16 rounding of values below 8
            raise SystemExit(f"{name}: compiled read differs from eager by {err:.3g}")
        rows[f"{name}, eager"] = ms(eager, reps)
        rows[f"{name}, compiled"] = ms(compiled, reps)
    return {"seqs": seqs, "context": context, "ms": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--dtypes", nargs="+", default=["int4", "k4v2", "int2"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine_throughput import cpu_flags  # a sibling script

    with torch.inference_mode():
        cases = [case(s, args.context, args.reps, args.dtypes) for s in args.seqs]
    names = list(cases[0]["ms"])
    print(f"\none layer's K+V read, {KV_HEADS} KV heads of {HEAD_DIM}, into bf16, {args.context} tokens per sequence, "
          f"{args.threads} threads ({platform.processor() or platform.machine()}; CPU flags: {cpu_flags()}); "
          "ms per read")
    width = max(len(n) for n in names) + 2
    print(f"{'read':<{width}s}" + "".join(f"{c['seqs']:>10d} seq" for c in cases))
    for name in names:
        print(f"{name:<{width}s}" + "".join(f"{c['ms'][name]:14.3f}" for c in cases))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "cpu_flags": cpu_flags(), "context": args.context,
                                         "cases": cases}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
