"""How far a prompt's prefill drifts from the bf16 cache, by KV dtype and by how a step reads its new rows.

A prompt's tokens are written to the cache and attended in the same step. Served (``LLM.generate``),
a step reads its new rows exact and everything written before as stored (int4/int2 always did;
FP8/INT8 too). ``LLM.score`` has each FP8/INT8 token read only its own row exact and the others as
stored, as decoding the text token by token would: measured beside it. Each prompt token's logprob is compared
with the bf16 cache's (mean absolute difference) and its perplexity reported, on calibration text
(never the evaluation ranges).

    python benchmarks/prefill_fidelity.py --json benchmarks/results/prefill_fidelity.json
"""
from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch


def served_logprobs(llm, windows: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (from the second on) through ``generate``: own rows read exact."""
    from runtime.engine.sampling import SamplingParams

    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    return [[t.logprob for t in o.prompt_logprobs[1:]] for o in outs]


def decoded_logprobs(llm, windows: list[list[int]]) -> list[list[float]]:
    """The same through ``score``: each FP8/INT8 token reads only its own row exact, as decoded."""
    from foundation.perplexity import target_logprobs

    return [target_logprobs(llm.score(ids)[:-1], torch.tensor(ids[1:])).tolist() for ids in windows]


def summary(lps: list[list[float]], ref: list[list[float]]) -> dict[str, float]:
    flat, flat_ref = [x for w in lps for x in w], [x for w in ref for x in w]
    return {"mean_abs_dlogprob": sum(abs(a - b) for a, b in zip(flat, flat_ref)) / len(flat),
            "ppl": math.exp(-sum(flat) / len(flat))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="wikipedia:calib")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3", "int8", "int4"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from foundation.perplexity import tokenize_range
    from runtime.cache.low_bit_kv import LOW_BIT_KV
    from runtime.llm import LLM

    def engine(kv: str | None) -> LLM:
        return LLM(args.model, kv_cache_dtype=kv, max_model_len=args.ctx + 2)

    bf16 = engine("bf16")
    ids = tokenize_range(bf16.tokenizer, args.text, max_tokens=args.ctx * args.windows).tolist()
    windows = [ids[i:i + args.ctx] for i in range(0, len(ids) - args.ctx + 1, args.ctx)]
    ref = served_logprobs(bf16, windows)
    rows = [{"kv": "bf16", "new_rows": "exact", **summary(ref, ref)}]
    del bf16
    for kv in args.kv_dtypes:
        llm = engine(kv)
        rows.append({"kv": kv, "new_rows": "exact (served prefill)", **summary(served_logprobs(llm, windows), ref)})
        if kv not in LOW_BIT_KV:  # int4/int2 read their new rows exact either way
            rows.append({"kv": kv, "new_rows": "own row only (as decoded)",
                         **summary(decoded_logprobs(llm, windows), ref)})
    base = rows[0]["ppl"]
    from engine_throughput import cpu_flags  # a sibling script

    print(f"{args.text}: {len(windows)} prompts of {args.ctx} tokens, activations {llm.dtype} "
          f"({platform.processor() or platform.machine()}; CPU flags: {cpu_flags()})")
    print("| KV cache | a step reads its new rows | mean abs d logprob vs bf16 | prompt ppl | change |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv']} | {r['new_rows']} | {r['mean_abs_dlogprob']:.4f} | {r['ppl']:.3f} | "
              f"{100 * (r['ppl'] / base - 1):+.2f}% |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"text": args.text, "ctx": args.ctx, "windows": len(windows),
                                         "activations": str(llm.dtype), "cpu_flags": cpu_flags(), "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
