"""Each weight storage at float32 vs bfloat16 activations on this CPU: decode speed and quality.

    python benchmarks/activation_dtype.py speed [--batch 1 8] [--new-tokens 32] [--json PATH]
    python benchmarks/activation_dtype.py quality [--tokens 4096] [--json PATH]

The default model quantized by RTN to each scheme ``compress quantize`` writes by default (dense
fp32 as stored, W4A16 g32, W8A16, FP8 weight-only, FP8_DYNAMIC, W8A8), each run by kvslim with
``dtype=float32`` and ``dtype=bfloat16``:
- speed: aggregate generated tokens/s (``LLM.generate``) for ``--batch`` prompts of 64
  ``wikipedia:eval`` tokens, greedy, EOS ignored, best of ``--repeats``; run it on idle cores;
- quality: perplexity through the engine's paged cache (``Engine.score``, as served; KV in the
  activation dtype) on the first ``--tokens`` tokens of ``wikipedia:eval``, context 512, stride
  256, and the largest |logit| difference bf16 vs fp32 over the first window.
What ``dtype="auto"`` picks (``runtime.model.layers.activation_dtype``) is printed beside the CPU flags.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

SCHEMES = ("dense", "int4", "int8", "fp8-weight-only", "fp8", "w8a8")
DTYPES = ("float32", "bfloat16")


def checkpoints(src: Path, kinds: list[str], work: Path):
    """``(kind, path)`` for each storage, quantized by RTN into ``work`` (dense: the source)."""
    from compress.quantize import quantize_checkpoint
    from foundation.schemes import default_scheme

    for kind in kinds:
        yield kind, src if kind == "dense" else quantize_checkpoint(src, work / kind, default_scheme(kind),
                                                                      progress=False).out


def speed(src: Path, args) -> list[dict]:
    from runtime.engine.sampling import SamplingParams
    from runtime.llm import LLM

    ids = eval_ids(src, 64 * max(args.batch))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtype-speed-") as work:
        for kind, path in checkpoints(src, args.schemes, Path(work)):
            for dtype in DTYPES:
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
    print("\nbf16 / fp32 speed ratio:")
    for kind in args.schemes:
        for batch in args.batch:
            f32, b16 = (next(r["tokens_per_s"] for r in rows if r["scheme"] == kind and r["dtype"] == d
                             and r["batch"] == batch) for d in DTYPES)
            print(f"{kind:16s} batch {batch:3d}: {b16 / f32:5.2f}x")
    return rows


def quality(src: Path, args) -> list[dict]:
    from foundation.perplexity import perplexity
    from runtime.engine.engine import Engine, EngineConfig

    ids = torch.tensor(eval_ids(src, args.tokens))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtype-quality-") as work:
        for kind, path in checkpoints(src, args.schemes, Path(work)):
            first, ppl = {}, {}
            for dtype in DTYPES:
                engine = Engine.from_checkpoint(path, EngineConfig(dtype=dtype, max_num_batched_tokens=512,
                                                                   max_model_len=514, kv_cache_bytes=64 << 20))
                first[dtype] = engine.score(ids[:512].tolist())
                ppl[dtype] = perplexity(lambda x: engine.score(x[0])[None], ids, "wikipedia:eval").perplexity
            diff = float((first["bfloat16"] - first["float32"]).abs().max())
            delta = 100 * (ppl["bfloat16"] / ppl["float32"] - 1)
            rows.append({"scheme": kind, "perplexity_fp32": ppl["float32"], "perplexity_bf16": ppl["bfloat16"],
                         "delta_pct": round(delta, 3), "max_abs_logit_diff": round(diff, 4)})
            print(f"{kind:16s} fp32 {ppl['float32']:.4f}  bf16 {ppl['bfloat16']:.4f} ({delta:+.2f}%)  "
                  f"max |logit diff| {diff:.3f}", flush=True)
    return rows


def eval_ids(src: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from foundation.perplexity import tokenize_range

    return tokenize_range(AutoTokenizer.from_pretrained(src), "wikipedia:eval", max_tokens=n).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measure", choices=("speed", "quality"))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from foundation.model_source import resolve_model
    from runtime.model.layers.activation_dtype import (
        CpuFeatures,
        choose_activation_dtype,
    )

    src = resolve_model("smollm2")
    features = CpuFeatures.detect()
    auto = choose_activation_dtype("auto", (), "cpu", features).name  # the CPU decides, not the weights
    print(f"CPU: {features.describe()}; auto -> {auto}; torch {torch.__version__}", flush=True)
    rows = speed(src, args) if args.measure == "speed" else quality(src, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"measure": args.measure, "cpu_flags": features.describe(), "auto": auto,
                                         "torch": torch.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
