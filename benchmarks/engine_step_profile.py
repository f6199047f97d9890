"""Where one engine decode step spends its time: torch.profiler op shares and cProfile shares.

Fills the engine with ``--concurrency`` requests of ``--prompt-tokens`` real tokens, steps until
every request is decoding, then profiles ``--steps`` decode steps. Prints the share of self CPU
time per op type (torch.profiler, shapes recorded) and the top Python functions by cumulative
time (cProfile). Shares only: on a shared machine the absolute times are not figures.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/engine_step_profile.py --concurrency 32
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402


def build_engine(model: str, dtype: str, kv_dtype: str | None, concurrency: int, prompt_tokens: int):
    from transformers import AutoTokenizer

    from compress.model_source import resolve_model
    from eval.perplexity import tokenize_range
    from runtime.engine import Engine, EngineConfig
    from runtime.sampling import SamplingParams

    model_dir = resolve_model(model)
    ids = tokenize_range(AutoTokenizer.from_pretrained(model_dir), "wikipedia:eval",
                         max_tokens=concurrency * prompt_tokens).tolist()
    prompts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(concurrency)]
    engine = Engine.from_checkpoint(model_dir, EngineConfig(
        dtype=dtype, kv_dtype=kv_dtype, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512,
        kv_cache_bytes=1 << 30, enable_prefix_caching=False,
    ))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()
    engine.step()  # one plain decode step as warm-up
    return engine


def op_shares(engine, steps: int) -> list[tuple[str, float, int]]:
    """(op name, share of self CPU time, calls) over ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
    self_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in prof.key_averages():
        self_us[e.key] += e.self_cpu_time_total
        calls[e.key] += e.count
    total = sum(self_us.values()) or 1.0
    rows = sorted(((k, v / total, calls[k]) for k, v in self_us.items()), key=lambda r: -r[1])
    print("\nself CPU time by op (torch.profiler); top shapes for the heaviest ops:")
    for name, share, n in rows[:20]:
        print(f"  {name:40s} {100 * share:5.1f}%  {n:6d} calls")
    by_shape = prof.key_averages(group_by_input_shape=True)
    for op in ("aten::addmm", "aten::mm", "aten::linear", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select"):
        top = sorted((e for e in by_shape if e.key == op), key=lambda e: -e.self_cpu_time_total)[:4]
        for e in top:
            print(f"  {op:40s} {100 * e.self_cpu_time_total / total:5.1f}%  {e.count:5d}x  {e.input_shapes}")
    return rows


def py_shares(engine, steps: int, top: int = 25) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    print("\ncProfile, cumulative:")
    print(buf.getvalue())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(args.model, args.dtype, args.kv_dtype, args.concurrency, args.prompt_tokens)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - t0) / args.steps
    print(f"{args.concurrency} seqs decoding, {args.dtype}, KV {engine.kv_spec.groups[0].kv_dtype}, "
          f"{args.threads} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}: "
          f"{step_s * 1e3:.0f} ms/step on this (possibly loaded) machine")
    op_shares(engine, args.steps)
    py_shares(engine, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
