"""Decode speed of each weight storage at float32 vs bfloat16 activations on this CPU.

    python benchmarks/activation_dtype_speed.py [--batch 1 8] [--new-tokens 32] [--json PATH]

The default model quantized by RTN to each scheme ``compress quantize`` writes (dense fp32 as
stored, W4A16 g32, W8A16, FP8 weight-only, FP8_DYNAMIC, W8A8), each served by ``LLM`` with
``dtype=float32`` and ``dtype=bfloat16``: aggregate generated tokens/s for ``--batch`` prompts of
64 ``wikipedia:eval`` tokens, greedy, EOS ignored, best of ``--repeats``. What ``dtype="auto"``
picks (``runtime.layers.activation_dtype``) is printed beside the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

SCHEMES = ("dense", "int4", "int8", "fp8-weight-only", "fp8", "w8a8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    from compress.model_source import resolve_model
    from compress.quantize import quantize_checkpoint
    from compress.schemes import default_scheme
    from eval.perplexity import tokenize_range
    from runtime.layers.activation_dtype import CpuFeatures, choose_activation_dtype
    from runtime.llm import LLM
    from runtime.sampling import SamplingParams

    src = resolve_model("smollm2")
    ids = tokenize_range(AutoTokenizer.from_pretrained(src), "wikipedia:eval", max_tokens=64 * max(args.batch)).tolist()
    features = CpuFeatures.detect()
    auto = {k: choose_activation_dtype("auto", () if k == "dense" else (default_scheme(k),), "cpu", features).name
            for k in args.schemes}
    print(f"CPU: {features.describe()}; auto -> {auto}; torch {torch.__version__}", flush=True)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    work = Path(tempfile.mkdtemp(prefix="dtype-speed-"))
    rows = []
    try:
        for kind in args.schemes:
            path = src if kind == "dense" else quantize_checkpoint(
                src, work / kind, default_scheme(kind), progress=False).out
            for dtype in ("float32", "bfloat16"):
                llm = LLM(path, dtype=dtype, max_model_len=64 + args.new_tokens + 8)
                llm.generate([ids[:8]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
                for batch in args.batch:
                    prompts = [ids[64 * i:64 * (i + 1)] for i in range(batch)]
                    best = 0.0
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        out = llm.generate(prompts, params)
                        seconds = time.perf_counter() - start
                        best = max(best, sum(len(o.outputs[0].token_ids) for o in out) / seconds)
                    rows.append({"scheme": kind, "dtype": dtype, "batch": batch, "tokens_per_s": round(best, 1)})
                    print(f"{kind:16s} {dtype:9s} batch {batch:3d}: {best:7.1f} tok/s", flush=True)
                del llm
            if kind != "dense":
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nbf16 / fp32 speed ratio:")
    for kind in args.schemes:
        for batch in args.batch:
            f32, b16 = (next(r["tokens_per_s"] for r in rows if r["scheme"] == kind and r["dtype"] == d
                             and r["batch"] == batch) for d in ("float32", "bfloat16"))
            print(f"{kind:16s} batch {batch:3d}: {b16 / f32:5.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu_flags": features.describe(), "auto": auto,
                                         "torch": torch.__version__, "new_tokens": args.new_tokens,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
