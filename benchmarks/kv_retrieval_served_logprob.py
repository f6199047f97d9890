"""Retrieval as a continuous figure, served: the key's teacher-forced log-probability per KV dtype.

A hit rate at 4 prompts a depth moves in steps of 25 points and flips on a near-tie; the
log-probability of the answer's tokens does not. Each retrieval prompt runs through the kvslim
engine with the KV cache really compressed, as `LLM` serves one request: the prompt prefilled in
chunks of ``--prefill-chunk`` (each chunk's new rows read exact), then the answer (``" " + key``)
fed one token at a time as decoded. Reported per task and depth: the mean log-probability of the
answer's tokens, and how many prompts have every one of them as the argmax (greedy's answer).
Packed KV's variants are KV dtype names too (``int4:keys-unrotated``: ``foundation.kv_dtype_mix``).

    python benchmarks/kv_retrieval_served_logprob.py gemma3-270m --kv bf16 int4 int4:keys-unrotated \\
        --tasks passkey,needle --ctx 8192 --json runs/gemma_retrieval_logprob.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint dir or a model name (smollm2, gemma3-270m)")
    ap.add_argument("--kv", nargs="+", default=["bf16", "int4"], help="KV dtypes (variants too: int4:exact-first-block)")
    ap.add_argument("--tasks", default="passkey,needle")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
    ap.add_argument("--samples", type=int, default=4, help="prompts per task and depth")
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="as LLM's default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from eval.retrieval_logprob import answer_ids, served_answers
    from eval.retrieval_task import WORDINGS, RetrievalTask
    from runtime.engine.engine import Engine
    from runtime.llm import LLM

    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in WORDINGS]:
        raise SystemExit(f"unknown retrieval task(s) {', '.join(unknown)}; choose from {', '.join(WORDINGS)}")
    llm = LLM(args.checkpoint)
    prompts = {t: RetrievalTask(t, (args.ctx,), tuple(args.depths), args.samples).prompts(llm.tokenizer) for t in tasks}
    encoded = {t: [answer_ids(llm.tokenizer, p.text, p.answer) for p in ps] for t, ps in prompts.items()}
    longest = max(len(a) + len(b) for pairs in encoded.values() for a, b in pairs)
    if longest > llm.max_model_len:
        raise SystemExit(f"--ctx {args.ctx}: prompts and answers of up to {longest} tokens exceed the model's "
                         f"{llm.max_model_len}")
    results: dict[str, dict] = {}
    for kv in args.kv:
        start = time.time()
        engine = Engine.sized_for(llm.model, longest, 1, max_num_batched_tokens=args.prefill_chunk, kv_dtype=kv)
        per_task = {}
        for task, pairs in encoded.items():
            by_depth: dict[int, list[tuple[float, bool]]] = {}
            for p, measured in zip(prompts[task], served_answers(engine, pairs, args.prefill_chunk)):
                by_depth.setdefault(p.depth, []).append(measured)
            per_task[task] = {str(d): {"mean_logprob": sum(x for x, _ in v) / len(v),
                                       "argmax": sum(h for _, h in v), "logprobs": [x for x, _ in v]}
                              for d, v in by_depth.items()}
        results[kv] = per_task
        line = "  ".join(f"{t} " + " ".join(f"{r['mean_logprob']:.2f}({r['argmax']})" for r in per_task[t].values())
                         for t in tasks)
        print(f"{kv:24s} {line}  ({time.time() - start:.0f}s)", flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({
            "checkpoint": str(args.checkpoint), "activations": str(llm.dtype), "ctx": args.ctx, "depths": args.depths,
            "samples": args.samples, "prefill_chunk": args.prefill_chunk, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    from foundation.errors import KvslimError

    try:
        raise SystemExit(main())
    except KvslimError as e:  # a bad checkpoint or KV dtype: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
