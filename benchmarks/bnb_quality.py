"""bitsandbytes NF4 / LLM.int8 beside our INT4 / INT8 on the same texts: bytes, perplexity, 3 tasks.

    python benchmarks/bnb_quality.py [--checkpoint NAME=DIR ...] [--work runs/bnb_quality]

Every checkpoint is written by `compress quantize` (``--int8``, ``--int4 --asymmetric`` RTN,
``--nf4``, ``--int8-bnb``; all ``--dtype bfloat16``, so embeddings weigh the same) plus any
``--checkpoint`` (e.g. a GPTQ one), and evaluated by `compress eval`'s pack through the ``hf``
backend (transformers, fp32 activations; bitsandbytes Linears as its users run them, ours
dequantized by compressed-tensors): ``ppl_wikipedia`` (``wikipedia:eval``, first 8,192 tokens,
context 512), arc_easy, hellaswag, piqa at the pack's default doc limits. Results are cached per
checkpoint bytes (``eval.results_cache``). Writes ``benchmarks/results/bnb_quality.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
from importlib.metadata import version
from pathlib import Path

from cli.main import main as compress
from eval.cached_evaluation import evaluate_cached
from eval.lm_eval_runner import EvalPlan
from foundation.model_source import resolve_model

RESULTS = Path(__file__).parent / "results" / "bnb_quality.json"
TASKS = ["ppl_wikipedia", "arc_easy", "hellaswag", "piqa"]
FLAGS = {
    "kvslim_int8": ["--int8"],
    "kvslim_int4_asym_rtn": ["--int4", "--asymmetric"],
    "bnb_nf4": ["--nf4"],
    "bnb_int8": ["--int8-bnb"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--work", type=Path, default=Path("runs/bnb_quality"))
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    checkpoints = {"original": resolve_model("smollm2")}
    for name, flags in FLAGS.items():
        out = args.work / name
        if not out.exists():
            rc = compress(["quantize", "smollm2", *flags, "--dtype", "bfloat16", "-o", str(out), "--no-progress"])
            if rc:
                raise SystemExit(rc)
        checkpoints[name] = out
    checkpoints.update(dict(c.split("=", 1) for c in args.checkpoint))
    plan = EvalPlan.make(TASKS, None, None, 8)
    rows = {}
    for name, path in checkpoints.items():
        results, _ = evaluate_cached(Path(path), plan, "hf")
        rows[name] = {"checkpoint": str(path),
                      "mib": sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**20,
                      "scores": {t: {"metric": s.metric, "value": s.value, "stderr": s.stderr, "n": s.num_samples}
                                 for t, s in results.scores.items()},
                      "eval_seconds": results.seconds}
        print(json.dumps({name: rows[name]}), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"tasks": TASKS, "limits": plan.limits, "backend": "hf (fp32)",
                                     "bitsandbytes": version("bitsandbytes"), "machine": platform.processor(),
                                     "rows": rows}, indent=2))
    base = rows["original"]["scores"]["ppl_wikipedia"]["value"]
    print(f"\n{'checkpoint':<24} {'MiB':>6} {'ppl':>8} {'vs orig':>8} " + " ".join(f"{t:>10}" for t in TASKS[1:]))
    for name, r in rows.items():
        s = r["scores"]
        ppl = s["ppl_wikipedia"]["value"]
        print(f"{name:<24} {r['mib']:>6.1f} {ppl:>8.3f} {(ppl / base - 1) * 100:>+7.2f}% "
              + " ".join(f"{s[t]['value']:>10.3f}" for t in TASKS[1:]))


if __name__ == "__main__":
    main()
