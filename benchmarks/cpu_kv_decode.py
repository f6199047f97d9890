"""Decode speed on the CPU at long context per KV cache, quantized reads compiled and eager, side by side.

Each row (``CKPT`` or ``CKPT@KV``, as ``compress report`` takes them) gets an engine holding ``--seqs``
requests whose ``--context - 64``-token ``wikipedia:eval`` prompts are prefilled before any timing. Then
``--rounds`` rounds, each row in turn and, for a quantized cache, each read in turn (compiled: one fused
pass per block read, ``runtime.cache.compiled_kv_read``; eager: ``KVSLIM_EAGER_KV_READ=1``): one
untimed step, then ``--steps`` timed decode steps. Interleaving the rows in every round keeps a
drifting VM's speed out of the ratios; the table gives the median step over the rounds.

    python benchmarks/cpu_kv_decode.py smollm2@bf16 smollm2@int4 out/demo/smollm2-kv-plan \\
        --json benchmarks/results/cpu_kv_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

EAGER_ENV = "KVSLIM_EAGER_KV_READ"


def _engine(entry: str, seqs: int, prompt_tokens: int):
    from eval.report import _eval_token_ids
    from foundation.model_source import resolve_model
    from runtime.cache.kv_dtype_choices import cache_kv_dtype, is_kv_cache_dtype
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams

    ckpt, at, kv = entry.rpartition("@")
    if not (at and is_kv_cache_dtype(kv)):
        ckpt, kv = entry, None
    kv = cache_kv_dtype(kv) if kv else None  # "fp8" -> the cache's fp8_e4m3
    path = resolve_model(ckpt)
    engine = Engine.from_checkpoint(path, EngineConfig(dtype="auto", max_num_seqs=seqs, kv_dtype=kv,
                                                       enable_prefix_caching=False))
    ids = _eval_token_ids(path, seqs * prompt_tokens)
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    rids = {engine.add_request(ids[i * prompt_tokens:(i + 1) * prompt_tokens], params) for i in range(seqs)}
    started: set[int] = set()
    while started != rids:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    return engine


def _step_ms(engine, steps: int) -> float:
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="CKPT or CKPT@KV (a --kv-cache-dtype name)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch

    from engine_throughput import cpu_flags  # a sibling script

    torch.set_num_threads(args.threads)
    engines = {entry: _engine(entry, args.seqs, args.context - 64) for entry in args.checkpoints}
    reads = {entry: ("compiled", "eager") if any(g.quantized or g.bits for g in e.kv_spec.groups) else ("one gather",)
             for entry, e in engines.items()}
    times: dict[tuple[str, str], list[float]] = {(entry, r): [] for entry in engines for r in reads[entry]}
    for _ in range(args.rounds):
        for entry, engine in engines.items():
            for read in reads[entry]:
                os.environ[EAGER_ENV] = "1" if read == "eager" else "0"
                times[(entry, read)].append(_step_ms(engine, args.steps))
    os.environ.pop(EAGER_ENV)
    base = statistics.median(times[next(iter(times))])
    rows = [{"checkpoint": entry, "kv": ", ".join(dict.fromkeys(g.kv_dtype for g in engines[entry].kv_spec.groups)),
             "read": read, "step_ms": statistics.median(ts), "tokens_per_s": args.seqs * 1e3 / statistics.median(ts),
             "vs_first_row": base / statistics.median(ts)} for (entry, read), ts in times.items()]
    print(f"\ndecode, {args.seqs} requests at ~{args.context} tokens, median step of {args.rounds} rounds x "
          f"{args.steps} steps, {args.threads} threads ({platform.processor() or platform.machine()}; CPU flags: "
          f"{cpu_flags()})")
    print(f"{'checkpoint':<34s} {'KV':<9s} {'read':<10s} {'step ms':>8s} {'tok/s':>7s} {'vs first':>8s}")
    for r in rows:
        print(f"{r['checkpoint']:<34s} {r['kv']:<9s} {r['read']:<10s} {r['step_ms']:8.1f} {r['tokens_per_s']:7.1f} "
              f"{r['vs_first_row']:7.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"context": args.context, "seqs": args.seqs, "rounds": args.rounds,
                                         "steps": args.steps, "threads": args.threads, "cpu_flags": cpu_flags(),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
