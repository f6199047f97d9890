"""What int2 KV's clipped key ranges and rotated values cost on the CPU, the same engine side by side
(a fresh engine per variant and round, rounds interleaved, best of each):
- decode: 8 requests of 64 ``wikipedia:eval`` tokens, 32 new tokens (a rotation in and out per layer
  and step);
- prefill: 2 prompts of 2,047 ``wikipedia:eval`` tokens, one new token each (every block quantized
  on write: where clipping's candidate ranges are searched).

    python benchmarks/int2_storage_cost.py --json benchmarks/results/int2_storage_cost.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from foundation.perplexity import tokenize_range
    from runtime.engine.engine import Engine
    from runtime.engine.sampling import SamplingParams
    from runtime.llm import LLM
    from runtime.model.layers.activation_dtype import CpuFeatures

    variants = {  # row -> the KV dtype name that serves it
        "as served (keys clipped, values rotated)": "int2",
        "keys not clipped": "int2:keys-unclipped",
        "values not rotated": "int2:values-unrotated",
        "neither": "int2:keys-unclipped+values-unrotated",
    }
    llm = LLM(args.model, max_model_len=2050)
    ids = tokenize_range(llm.tokenizer, "wikipedia:eval", max_tokens=2 * 2048).tolist()
    jobs = {  # job -> (prompts, new tokens each)
        "decode, tok/s": ([ids[i * 64:(i + 1) * 64] for i in range(8)], 32),
        "prefill, tokens/s": ([ids[:2047], ids[2048:4095]], 1),
    }

    def run(prompts: list[list[int]], new: int, kv_dtype: str) -> float:
        """Tokens per second on a fresh engine: prompt tokens for a prefill; for decode, as
        ``compress report`` times it (prompt + ``new`` tokens minus prompt + 1, per token after the first)."""
        engine = Engine.sized_for(llm.model, 2050, len(prompts), max_num_batched_tokens=1024, kv_dtype=kv_dtype,
                                  enable_prefix_caching=False)

        def timed(n: int) -> float:
            t = time.perf_counter()
            engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - t

        prefill = timed(1)
        if new == 1:
            return sum(map(len, prompts)) / prefill
        return len(prompts) * (new - 1) / (timed(new) - prefill)

    best = {(j, v): 0.0 for j in jobs for v in variants}
    for round_ in range(args.rounds + 1):  # round 0 warms
        for name, kv_dtype in variants.items():
            for job, (prompts, new) in jobs.items():
                tps = run(prompts, new, kv_dtype)
                if round_:
                    best[job, name] = max(best[job, name], tps)
    cpu_flags = CpuFeatures.detect().describe()
    rows = [{"job": job, "int2": name, "tokens_per_s": tps} for (job, name), tps in best.items()]
    print(f"CPU flags: {cpu_flags}; activations {llm.dtype}")
    print("| job | int2 KV | tokens/s (best of rounds) |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['job']} | {r['int2']} | {r['tokens_per_s']:.1f} |")
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({"cpu_flags": cpu_flags, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
