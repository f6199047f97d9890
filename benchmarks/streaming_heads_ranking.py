"""Which KV heads to keep full when the rest stream: rankings at the same bytes, on calibration
retrieval the heads were not ranked on.

For a budget (a fraction of the bf16 original's KV bytes per token at ``--ctx``) and one window,
the planner's streaming-head candidate is built three ways: the heads with the most attention mass
beyond the window on calibration text (``mass``), the heads the question's attention finds the fact
through (``retrieval``, ``attention_variants.retrieval_heads``), and the heads whose streaming alone
would cost the answers most (``gate``, the gradient at DuoAttention's gate,
``attention_variants.retrieval_gates``); with ``--pruned-gate`` a fourth, the gates re-measured step
by step as the lowest-scored heads stream (``pruned gate``). The retrieval rankings use the planner's ranking prompts
(``eval.kv_plan.ranking_prompts``: sample ``--ranking-sample`` of ``passkey_calib`` and
``needle_calib`` at depths 0-75%). Each candidate is served (its cache really quantized) on
``--samples`` other calibration prompts a task and depth (depths 0-100%, the samples after those)
and on the planner's dev slice (``wikipedia:calib`` tokens [2N, 4N)). Never evaluation text.

    python benchmarks/streaming_heads_ranking.py smollm2 --budget 0.16 --window 512 \\
        --json benchmarks/results/streaming_heads_ranking_016.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a full-attention checkpoint dir or a model name (smollm2)")
    ap.add_argument("--budget", type=float, default=0.16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--kv-dtype", default="int4")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ranking-sample", type=int, default=1, help="the sample index the heads are ranked on")
    ap.add_argument("--samples", type=int, default=4, help="measured prompts per task and depth, after it")
    ap.add_argument("--pruned-gate", action="store_true",
                    help="a fourth ranking: the gates re-measured as the lowest heads stream, down to the "
                         "heads the budget keeps full (pruned_gate_order)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not 0 < args.window < args.ctx or not 0 < args.budget <= 1 or args.samples < 1 or args.ranking_sample < 0:
        print(f"error: need 0 < --window ({args.window}) < --ctx ({args.ctx}), --budget in (0, 1] ({args.budget:g}), "
              f"--samples >= 1 ({args.samples}) and --ranking-sample >= 0 ({args.ranking_sample})", file=sys.stderr)
        return 2

    from eval.kv_plan import (PLAN_SINKS, RETRIEVAL_CALIB, full_heads, head_candidates, original_bytes, plan_texts,
                              ranking_prompts, retrieval_prompts)
    from eval.kv_plan_measurements import gate_rank, rank, retrieval_rank, served_perplexity, served_retrieval
    from foundation.calibration import load_tokenizer
    from foundation.checkpoint import Checkpoint
    from foundation.errors import KvslimError
    from foundation.model_source import resolve_model

    try:
        ckpt = Checkpoint.open(resolve_model(args.checkpoint))
    except KvslimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config, ctx, w = ckpt.config, args.ctx, args.window
    tokenizer = load_tokenizer(ckpt.path)
    first = args.ranking_sample + 1
    measured = retrieval_prompts(tokenizer, ctx, args.samples, first_sample=first)
    ranked_on = ranking_prompts(tokenizer, ctx, args.ranking_sample)
    calib_ids, dev, _, dev_text = plan_texts(tokenizer, ctx)

    timings, rankings = {}, {}
    t = time.perf_counter()
    rankings["mass"] = rank(ckpt.path, calib_ids, (w,), PLAN_SINKS)[1][w]
    timings["mass"] = time.perf_counter() - t
    t = time.perf_counter()
    rankings["retrieval"] = retrieval_rank(ckpt.path, tokenizer, ranked_on)
    timings["retrieval"] = time.perf_counter() - t
    t = time.perf_counter()
    rankings["gate"] = gate_rank(ckpt.path, tokenizer, ranked_on, (w,), PLAN_SINKS)[w]
    timings["gate"] = time.perf_counter() - t
    original = original_bytes(config, ctx)
    if args.pruned_gate:  # down to the heads the budget keeps full
        gate_cands = head_candidates(config, ctx, args.budget * original, {w: rankings["gate"]}, original,
                                     args.kv_dtype, {w: []})
        full = full_heads(gate_cands[0].choice, config["num_key_value_heads"]) if gate_cands else 1
        t = time.perf_counter()
        rankings["pruned gate"] = gate_rank(ckpt.path, tokenizer, ranked_on, (w,), PLAN_SINKS, {w: full})[w]
        timings["pruned gate"] = time.perf_counter() - t
    orig = served_retrieval(ckpt.path, config, "bf16", measured, tokenizer, ctx)
    orig_ppl = served_perplexity(ckpt.path, config, "bf16", dev, dev_text, ctx)
    rows = [{"ranking": "bf16, full attention", "kv_bytes_per_token": original, "dev_ppl": orig_ppl,
             "retrieval": orig.accuracy(), "mean_logprob": sum(orig.logprobs) / len(measured)}]
    for by, ranked in rankings.items():
        cands = head_candidates(config, ctx, args.budget * original, {w: ranked}, original, args.kv_dtype, {w: []})
        if not cands:
            print(f"error: no {args.kv_dtype} streaming-head layout over window {w} fits {args.budget:g}", file=sys.stderr)
            return 2
        c = cands[0]
        cfg = c.choice.config(config)
        r = served_retrieval(ckpt.path, cfg, args.kv_dtype, measured, tokenizer, ctx)
        drops = [o - x for o, x, hit in zip(orig.logprobs, r.logprobs, orig.hits) if hit]
        rows.append({"ranking": by, "rank_seconds": round(timings[by], 1),
                     "full_kv_heads": sum(config["num_key_value_heads"] - len(s) for s in c.choice.streaming),
                     "kv_bytes_per_token": c.kv_bytes_per_token, "times_smaller": c.times_smaller,
                     "dev_ppl": served_perplexity(ckpt.path, cfg, args.kv_dtype, dev, dev_text, ctx),
                     "retrieval": r.accuracy(), "mean_logprob": sum(r.logprobs) / len(measured),
                     "max_logprob_drop": max(drops, default=0.0), "mean_logprob_drop": sum(drops) / max(1, len(drops)),
                     "streaming_kv_heads": [list(s) for s in c.choice.streaming]})

    print(f"{args.kv_dtype} KV, streaming heads over {PLAN_SINKS} sinks + {w}, budget {args.budget:g} at {ctx}; "
          f"{len(measured)} calibration prompts ({args.samples} a task and depth), none ranked on")
    print("| full heads by | full KV heads | smaller | dev ppl | retrieval by depth 0/25/50/75/100% | "
          "mean answer log-prob | max drop |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for row in rows:
        acc = " ".join(f"{100 * a:.0f}" for a in row["retrieval"].values())
        print(f"| {row['ranking']} | {row.get('full_kv_heads', '-')} | {original / row['kv_bytes_per_token']:.2f}x | "
              f"{row['dev_ppl']:.3f} | {acc} | {row['mean_logprob']:.3f} | "
              f"{row.get('max_logprob_drop', 0.0):.3f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint, "ctx": ctx, "budget": args.budget,
                                         "window": w, "kv_dtype": args.kv_dtype, "sinks": PLAN_SINKS,
                                         "ranked_on": f"sample {args.ranking_sample} of {', '.join(RETRIEVAL_CALIB)}",
                                         "measured_on": f"samples {first}..{first + args.samples - 1}",
                                         "dev_text": dev_text,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
