"""What reading a decode step's own new row exact costs FP8/INT8 decode on the CPU (the torch path's
overlay, ``runtime.attention.paged._put_decode_rows``), against reading it back as stored: the same
engine, 8 requests of 64 ``wikipedia:eval`` tokens, 32 new tokens, rounds interleaved, best of each.

    python benchmarks/own_row_decode_cost.py --json benchmarks/results/own_row_decode_cost.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3", "int8"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from engine_throughput import cpu_flags  # a sibling script
    from foundation.perplexity import tokenize_range
    from runtime.attention import paged
    from runtime.engine.sampling import SamplingParams
    from runtime.llm import LLM

    overlay = paged._put_decode_rows
    reads = {"exact (served)": overlay, "as stored": lambda *a: None}
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = []
    for kv in args.kv_dtypes:
        llm = LLM(args.model, kv_cache_dtype=kv, max_model_len=256)
        ids = tokenize_range(llm.tokenizer, "wikipedia:eval", max_tokens=64 * 8).tolist()
        prompts = [ids[i * 64:(i + 1) * 64] for i in range(8)]
        llm.generate(prompts, sp)  # warm
        best = dict.fromkeys(reads, 0.0)
        try:
            for _ in range(args.rounds):
                for name, fn in reads.items():
                    paged._put_decode_rows = fn
                    t = time.perf_counter()
                    llm.generate(prompts, sp)
                    best[name] = max(best[name], 8 * 32 / (time.perf_counter() - t))
        finally:
            paged._put_decode_rows = overlay
        rows += [{"kv": kv, "own_row": name, "tokens_per_s": tps} for name, tps in best.items()]
    print(f"CPU flags: {cpu_flags()}; activations auto")
    print("| KV cache | decode step's own row read | tok/s (best of rounds) |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['kv']} | {r['own_row']} | {r['tokens_per_s']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_flags": cpu_flags(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
