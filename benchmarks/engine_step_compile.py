"""Does torch.compile (inductor's CPU code generation) shorten the engine's decode step?

    OMP_WAIT_POLICY=ACTIVE python benchmarks/engine_step_compile.py --model CKPT --dtype bfloat16

Fills the engine with ``--concurrency`` requests of 128 real tokens (``engine_step_profile``'s
setup), then times ``--steps`` decode steps with the decoder run eagerly, with every layer's
MLP and norms compiled, and with every whole decoder layer compiled (dynamo then traces into the
paged attention backend too, one graph per layer index). Prints a table and writes JSON; run it on idle cores.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import torch  # noqa: E402

from engine_step_profile import build_engine  # noqa: E402  (benchmarks/engine_step_profile.py)

MODES = ("eager", "compile_mlp_norms", "compile_layers")


def _compile(engine, mode: str) -> None:
    if mode == "compile_layers":
        # Each layer specializes its own graph (its index selects its cache group): room for all of them.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(engine.model.layers))
    for i, layer in enumerate(engine.model.layers):
        if mode == "compile_layers":
            engine.model.layers[i] = torch.compile(layer, dynamic=True)
        elif mode == "compile_mlp_norms":
            for name in ("mlp", "input_layernorm", "post_attention_layernorm"):
                setattr(layer, name, torch.compile(getattr(layer, name), dynamic=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "engine_step_compile.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.modes.split(","):
        engine = build_engine(args.model, args.dtype, None, args.concurrency, 128)
        _compile(engine, mode)
        t = time.perf_counter()
        for _ in range(args.warmup_steps):  # compiles (a few shapes) and warms up
            engine.step()
        warm = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - t) / args.steps * 1e3
        rows.append({"mode": mode, "step_ms": round(step_ms, 1), "warmup_s": round(warm, 1)})
        print(f"{mode:20s} {step_ms:7.1f} ms/step  (warm-up {warm:.1f} s)", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "model": str(args.model), "dtype": args.dtype, "concurrency": args.concurrency, "steps": args.steps,
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "torch": torch.__version__,
        "machine": f"{os.cpu_count()} CPUs, {args.threads} thread(s)", "rows": rows,
    }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
