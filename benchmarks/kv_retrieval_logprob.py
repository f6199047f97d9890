"""KV options ranked by calibration retrieval: the key's teacher-forced log-probability (simulated).

Each calibration retrieval prompt (``*_calib`` tasks, never evaluation text) runs once through the
transformers model with K/V fake-quantized as ``kv_quant_options.py`` stores them, the answer
appended; the figure is the mean log-probability of the key's tokens, and how many prompts have
every key token as the argmax. Continuous where hit rates at a few prompts a depth are not.

    python benchmarks/kv_retrieval_logprob.py '{"bits": 0}' '{"bits": 4}' '{"bits": 4, "k_rot": true}' \\
        --tasks needle_calib,multikey_calib --depths 0 25 50 --json runs/kv_retrieval_logprob.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("options", nargs="+", help="kv_quant_options specs as JSON ('{\"bits\": 0}': exact)")
    ap.add_argument("--tasks", default="needle_calib,multikey_calib")
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50])
    ap.add_argument("--samples", type=int, default=4, help="prompts per task and depth")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import kv_quant_options as kq
    from dev_slice import dev_model
    from transformers import AutoTokenizer

    from eval.retrieval_task import RetrievalTask

    tasks = [t for t in args.tasks.split(",") if t]
    if any(not t.endswith("_calib") for t in tasks):
        raise SystemExit("--tasks: calibration retrieval tasks only (*_calib)")
    _, _, _, model = dev_model(4096)
    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    current: list = [None]
    kq.install(current)
    prompts = [p for t in tasks
               for p in RetrievalTask(t, contexts=(args.ctx,), depths=tuple(args.depths), samples=args.samples).prompts(tok)]
    results = {}
    for text in args.options:
        current[0] = kq.Options(json.loads(text), model.config.head_dim)
        start = time.time()
        scored = [key_logprobs(model, tok, p.text + " ", p.answer) for p in prompts]
        logprobs = [float(lp.mean()) for lp, _ in scored]
        argmax = sum(hit for _, hit in scored)
        mean = sum(logprobs) / len(logprobs)
        results[text] = {"mean_key_logprob": mean, "all_key_tokens_argmax": argmax, "prompts": len(prompts),
                         "key_logprobs": logprobs}
        print(f"{mean:8.3f}  argmax {argmax}/{len(prompts)}  {text}  ({time.time() - start:.0f}s)", flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({"tasks": tasks, "depths": args.depths, "samples": args.samples,
                                                 "ctx": args.ctx, "results": results}, indent=2))
    return 0


def key_logprobs(model, tok, context: str, answer: str) -> tuple[torch.Tensor, bool]:
    """Teacher-forced log-probability of each of ``answer``'s tokens after ``context``, and whether
    every one of them is the argmax."""
    from foundation.perplexity import target_logprobs

    ids = tok(context, return_tensors="pt")["input_ids"]
    key = tok(answer, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    with torch.no_grad():
        logits = model(torch.cat([ids, key[None]], 1), use_cache=False).logits[0, ids.shape[1] - 1:-1]
    return target_logprobs(logits, key), bool((logits.argmax(-1) == key).all())


if __name__ == "__main__":
    raise SystemExit(main())
