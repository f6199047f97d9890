"""Where a decode step's time goes: GEMMs, attention, and everything else, eager vs compiled.

For each concurrency, ``c`` requests with 128-token ``wikipedia:eval`` prompts are prefilled, then
decode steps are timed (wall, no profiler) and profiled (``torch.profiler``, CPU). Each op's self
time falls in one class:

- **GEMM**: the Linears' kernels (``mm``/``addmm``, ``_int_mm``, torch's INT4/INT8 weight-only
  kernels, oneDNN's prepacked linears under compile);
- **attention**: SDPA's kernel itself;
- **other ops**: everything else torch ran (norms, rotary, residuals, activations, the paged cache's
  gathers and dequantization, cache writes, masks; inductor's fused loops when compiled);
- **outside ops**: step wall time the profiler saw no op in (Python, scheduling, sampling, dispatch).

The "non-kernel share" is (other ops + outside ops) / step time, from the profiled steps (the
profiler itself inflates small ops, so the share is an upper bound; the step times are unprofiled).
Compiled steps run with inductor's Python wrapper here (``DecodeGraphs.cpp_wrapper = False``): the C++
wrapper the engine uses is one profiler event for the whole graph.

    python benchmarks/decode_profile.py --json benchmarks/results/decode_profile.json
    python benchmarks/decode_profile.py --checkpoint runs/speed/int4-rtn --concurrency 1 32
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # idle cores: spinning is fastest (engine_throughput.py)

import torch  # noqa: E402

PROMPT_TOKENS = 128
GEMM_MARKS = ("aten::mm", "aten::addmm", "aten::_int_mm", "_weight_int4pack_mm", "_weight_int8pack_mm",
              "mkldnn::_linear_pointwise", "mkl::_mkl_linear", "onednn::", "aten::bmm")
ATTENTION_MARKS = ("scaled_dot_product",)


def op_class(name: str) -> str:
    if any(m in name for m in GEMM_MARKS):
        return "gemm"
    if any(m in name for m in ATTENTION_MARKS):
        return "attention"
    return "other"


def prefilled_engine(checkpoint: str, dtype: str, concurrency: int, compile_decode: bool):
    """An engine whose ``concurrency`` requests are past their prompts, decode bucket compiled."""
    from engine_throughput import ENGINE_SETTINGS, real_prompts  # a sibling script
    from transformers import AutoTokenizer

    from foundation.model_source import resolve_model
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams

    path = resolve_model(checkpoint)
    engine = Engine.from_checkpoint(path, EngineConfig(dtype=dtype, compile_decode=compile_decode, **ENGINE_SETTINGS))
    if engine.graphs is not None:
        # The C++ wrapper runs the whole graph as one profiler event: a Python wrapper keeps each op
        # visible, at ~1 ms a step more at one request (the graph call's own time, under "other ops").
        engine.graphs.cpp_wrapper = False
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for p in real_prompts(tokenizer, concurrency):
        engine.add_request(p, params)
    while engine.stats.generated_tokens < 4 * concurrency:  # prefill, then a few decode steps (compiles)
        engine.step()
    return engine


def profile(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_ms = (time.perf_counter() - t0) / steps * 1e3
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    ops = {}
    for e in prof.key_averages():
        us = e.self_cpu_time_total / steps
        split[op_class(e.key)] += us / 1e3
        ops[e.key] = (us / 1e3, e.count // steps)
    outside = max(0.0, profiled_ms - sum(split.values()))
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:8]
    return {"step_ms": step_ms, "profiled_step_ms": profiled_ms, "gemm_ms": split["gemm"],
            "attention_ms": split["attention"], "other_ops_ms": split["other"], "outside_ops_ms": outside,
            "non_kernel_share": (split["other"] + outside) / profiled_ms,
            "ops_per_step": sum(c for _, c in ops.values()),
            "top_ops": [{"op": k, "ms": v[0], "calls": v[1]} for k, v in top]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine_throughput import cpu_flags

    rows = []
    for c in args.concurrency:
        for mode in args.modes:
            t0 = time.perf_counter()
            engine = prefilled_engine(args.checkpoint, args.dtype, c, mode == "compiled")
            ready_s = time.perf_counter() - t0
            r = {"concurrency": c, "mode": mode, "ready_s": ready_s, **profile(engine, args.steps)}
            rows.append(r)
            print(f"c={c} {mode}: {r['step_ms']:.1f} ms/step, non-kernel {r['non_kernel_share']:.0%} "
                  f"({r['ops_per_step']} ops/step), ready in {ready_s:.0f} s", flush=True)
    flags = cpu_flags()
    print(f"\n{args.checkpoint}, activations {args.dtype}, {args.threads} threads, OMP_WAIT_POLICY="
          f"{os.environ['OMP_WAIT_POLICY']} ({platform.processor() or platform.machine()}; CPU flags: {flags})")
    print(f"{'c':>3s} {'mode':9s} {'step ms':>8s} {'GEMM':>6s} {'attn':>6s} {'other':>6s} {'outside':>8s} "
          f"{'non-kernel':>10s} {'ops':>6s}   (ms per profiled step)")
    for r in rows:
        print(f"{r['concurrency']:3d} {r['mode']:9s} {r['step_ms']:8.1f} {r['gemm_ms']:6.1f} {r['attention_ms']:6.1f} "
              f"{r['other_ops_ms']:6.1f} {r['outside_ops_ms']:8.1f} {r['non_kernel_share']:10.0%} {r['ops_per_step']:6d}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"checkpoint": args.checkpoint, "dtype": args.dtype, "threads": args.threads,
                                         "cpu_flags": flags, "steps": args.steps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
