"""KV options ranked by calibration retrieval: the key's teacher-forced log-probability (simulated).

Each calibration retrieval prompt (``*_calib`` tasks, never evaluation text) runs once through the
transformers model with K/V fake-quantized as ``kv_quant_options.py`` stores them, the answer
appended; the figure is the mean log-probability of the key's tokens, and how many prompts have
every key token as the argmax. Continuous where hit rates at a few prompts a depth are not. A spec's
``"block"`` sets the simulated block (key group and exact open block; default 64).

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
        spec = json.loads(text)
        kq.BLOCK = spec.get("block", 64)
        current[0] = kq.Options(spec, model.config.head_dim)
        start, logprobs, argmax = time.time(), [], 0
        for p in prompts:
            context = tok(p.text + " ", return_tensors="pt")["input_ids"]
            answer = tok(p.answer, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
            with torch.no_grad():
                logits = model(torch.cat([context, answer[None]], 1), use_cache=False).logits
            lp = torch.log_softmax(logits[0, context.shape[1] - 1:-1].float(), -1)
            logprobs.append(float(lp[torch.arange(len(answer)), answer].mean()))
            argmax += bool((lp.argmax(-1) == answer).all())
        mean = sum(logprobs) / len(logprobs)
        results[text] = {"mean_key_logprob": mean, "all_key_tokens_argmax": argmax, "prompts": len(prompts),
                         "key_logprobs": logprobs}
        print(f"{mean:8.3f}  argmax {argmax}/{len(prompts)}  {text}  ({time.time() - start:.0f}s)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"tasks": tasks, "depths": args.depths, "samples": args.samples,
                                         "ctx": args.ctx, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
