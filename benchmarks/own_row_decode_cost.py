"""What reading a token's own new FP8/INT8 row exact costs on the CPU, against reading it back as
stored, the same engine side by side (rounds interleaved, best of each):
- decode (the torch path's overlay, ``runtime.attention.paged._put_decode_rows``): 8 requests of 64
  ``wikipedia:eval`` tokens, 32 new tokens;
- ``Engine.score`` (``runtime.attention.paged._with_own_rows``, what ``compress report`` perplexity
  runs): 2 windows of 2,048 ``wikipedia:eval`` tokens.

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

    overlay, with_own = paged._put_decode_rows, paged._with_own_rows
    reads = {  # how a token reads its own row: the patches that give each
        "exact": (overlay, with_own),
        "as stored": (lambda *a: None, lambda kk, vv, allowed, *a: (kk, vv, allowed)),
    }
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = []
    for kv in args.kv_dtypes:
        llm = LLM(args.model, kv_cache_dtype=kv, max_model_len=2050)
        ids = tokenize_range(llm.tokenizer, "wikipedia:eval", max_tokens=2 * 2048).tolist()
        prompts = [ids[i * 64:(i + 1) * 64] for i in range(8)]
        windows = [ids[:2048], ids[2048:]]
        jobs = {"decode, tok/s": (lambda: llm.generate(prompts, sp), 8 * 32),
                "score, tokens/s": (lambda: [llm.score(w) for w in windows], 2 * 2048)}
        for job in jobs.values():
            job[0]()  # warm
        best = {(j, r): 0.0 for j in jobs for r in reads}
        try:
            for _ in range(args.rounds):
                for name, (decode_fn, score_fn) in reads.items():
                    paged._put_decode_rows, paged._with_own_rows = decode_fn, score_fn
                    for job, (run, tokens) in jobs.items():
                        t = time.perf_counter()
                        run()
                        best[job, name] = max(best[job, name], tokens / (time.perf_counter() - t))
        finally:
            paged._put_decode_rows, paged._with_own_rows = overlay, with_own
        rows += [{"kv": kv, "job": job, "own_row": name, "tokens_per_s": tps} for (job, name), tps in best.items()]
    print(f"CPU flags: {cpu_flags()}; activations auto")
    print("| KV cache | job | a token's own row read | tokens/s (best of rounds) |\n|---|---|---|---:|")
    for r in rows:
        print(f"| {r['kv']} | {r['job']} | {r['own_row']} | {r['tokens_per_s']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_flags": cpu_flags(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
