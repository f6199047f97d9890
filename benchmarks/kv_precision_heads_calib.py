"""KV bits per head on calibration data: what share of the heads that retrieve keeps int4.

Each row serves the checkpoint through the runtime with its KV cache really quantized and reports
the bytes per token at ``--ctx`` (by allocation), the dev-slice perplexity the planner uses
(``wikipedia:calib`` tokens [2N, 4N)), and the mean answer log-probability of calibration retrieval
prompts (``--tasks``, default the planner's ``passkey_calib`` + ``needle_calib``, ``--samples`` a
depth after the ``--ranking-samples`` the heads are ranked on, so never those; teacher-forced as served:
``eval.retrieval_logprob``) with how many are greedy's answer. A row is a KV dtype (``int4``), or
``SHARE@HIGH/LOW`` (``0.2@int4/int2``): the heads ranked by ``eval.kv_precision_heads`` on
``--ranking-samples`` prompts a depth of ``--ranking-tasks``, the top share in HIGH, the rest in LOW.
Never evaluation text.

    python benchmarks/kv_precision_heads_calib.py smollm2 --rows bf16 int4 int2 k3v2 0.2@int4/int2 \\
        0.4@int4/int2 --ranking-samples 1 --json benchmarks/results/kv_precision_heads_calib.json

``--lowered-first-block-exact`` simulates the lowered heads keeping each sequence's first block
exact, as full-attention int2 does (the runtime keeps it for full-attention groups only).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PREFILL_CHUNK = 1024  # LLM's default


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a full-attention checkpoint dir or a model name (smollm2)")
    ap.add_argument("--rows", nargs="+", default=["bf16", "int4", "int2", "0.2@int4/int2"])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=4, help="measured prompts per task and depth")
    ap.add_argument("--ranking-samples", type=int, default=4, help="prompts per task and depth the heads are ranked on")
    from eval.retrieval_task import RETRIEVAL_TASKS

    calib_tasks = [t for t in RETRIEVAL_TASKS if t.endswith("_calib")]
    ap.add_argument("--tasks", nargs="+", choices=calib_tasks, help="calibration tasks measured (default: the planner's)")
    ap.add_argument("--ranking-tasks", nargs="+", choices=calib_tasks,
                    help="calibration tasks the heads are ranked on (default: the planner's)")
    ap.add_argument("--lowered-first-block-exact", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    from eval.kv_plan import RETRIEVAL_CALIB, KvChoice, allocated_bytes, original_bytes, plan_texts, retrieval_prompts
    from eval.kv_plan_measurements import served_engine, served_perplexity
    from eval.kv_precision_heads import choose_precision_heads
    from eval.retrieval_logprob import answer_ids, served_answers
    from foundation.calibration import load_tokenizer
    from foundation.checkpoint import Checkpoint
    from foundation.errors import KvslimError
    from foundation.model_source import resolve_model

    if args.lowered_first_block_exact:
        import runtime.cache.kv_cache as kv_cache

        kv_cache.CacheGroup.exact_first_block = property(  # simulation only: whole-context windows too
            lambda g: g.recipe is not None and g.recipe.exact_first_block and (g.kind == "full" or g.sinks == 0))
    try:
        path = resolve_model(args.checkpoint)
        config = Checkpoint.open(path).config
        tok = load_tokenizer(path)
        _, dev, _, dev_text = plan_texts(tok, args.ctx)
        tasks, ranking_tasks = tuple(args.tasks or RETRIEVAL_CALIB), tuple(args.ranking_tasks or RETRIEVAL_CALIB)
        # measured prompts follow the ranked ones in each depth's seeded sequence: never ranked on
        named = [(name, p) for name in tasks
                 for p in retrieval_prompts(tok, args.ctx, args.samples, (name,), first_sample=args.ranking_samples)]
        names, prompts = [n for n, _ in named], [p for _, p in named]
        encoded = [answer_ids(tok, p.text, p.answer) for p in prompts]
        rows = []
        for label in args.rows:
            start = time.time()
            share, _, dtype = label.rpartition("@")
            layout = dict(config)
            if share:
                heads = choose_precision_heads(path, dtype, float(share), args.ctx, args.ranking_samples,
                                               ranking_tasks, lambda _: None)
                layout = KvChoice(dtype, heads.window, (), 0, heads.lowered).config(config)
            ppl = served_perplexity(path, layout, dtype, dev, dev_text, args.ctx)
            by_depth: dict[int, list[float]] = {}
            by_task: dict[str, list[float]] = {}
            hits = 0
            with served_engine(path, layout, dtype, args.ctx) as engine:
                served = served_answers(engine, encoded, PREFILL_CHUNK)
            for task, p, (lp, hit) in zip(names, prompts, served):
                by_depth.setdefault(p.depth, []).append(lp)
                by_task.setdefault(task, []).append(lp)
                hits += hit
            every = [x for xs in by_depth.values() for x in xs]
            nbytes = allocated_bytes(layout, dtype, args.ctx)
            rows.append({"row": label, "kv_bytes_per_token": nbytes,
                         "times_smaller": original_bytes(config, args.ctx) / nbytes, "dev_ppl": ppl,
                         "calib_logprob": sum(every) / len(every), "argmax": hits, "prompts": len(every),
                         "logprob_by_depth": {str(d): sum(v) / len(v) for d, v in sorted(by_depth.items())},
                         "logprob_by_task": {t: sum(v) / len(v) for t, v in by_task.items()}})
            per_task = "  ".join(f"{t} {v:.3f}" for t, v in rows[-1]["logprob_by_task"].items())
            print(f"{label:>24}  {nbytes:8,.0f} B/token  dev ppl {ppl:7.3f}  log-prob {rows[-1]['calib_logprob']:7.3f}  "
                  f"({per_task})  argmax {hits}/{len(every)}  ({time.time() - start:.0f} s)", flush=True)
    except KvslimError as e:
        print(f"kv_precision_heads_calib: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"checkpoint": str(args.checkpoint), "ctx": args.ctx, "samples": args.samples, "tasks": list(tasks),
               "ranking_samples": args.ranking_samples, "ranking_tasks": list(ranking_tasks),
               "lowered_first_block_exact": args.lowered_first_block_exact,
               "torch_threads": torch.get_num_threads(), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
