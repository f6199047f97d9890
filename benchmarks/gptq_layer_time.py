"""GPTQ wall time for one Linear at Llama-7B shapes (no checkpoint needed).

    python benchmarks/gptq_layer_time.py [--threads 2] [--out benchmarks/results/gptq_layer_time.json]

Random weights ([out, in] x 0.02) and a Hessian from 4,096 random correlated inputs; times
``gptq_quantize`` at the INT4 GPTQ defaults (W4A16_ASYM g32, act-order, mse ranges) and at FP8
(plain order, min-max) for q/o_proj (4096 x 4096), gate/up_proj (11008 x 4096) and down_proj
(4096 x 11008). Prints a table and writes JSON. To compare two versions of kvslim side by side,
run it from each (e.g. ``PYTHONPATH=<other worktree> python benchmarks/gptq_layer_time.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from compress.algorithms.gptq import default_options, gptq_quantize, hessian_from_inputs
from foundation.schemes import default_scheme

SHAPES = {"q/o_proj": (4096, 4096), "gate/up_proj": (11008, 4096), "down_proj": (4096, 11008)}
KINDS = ("int4", "fp8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gptq_layer_time.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(out_f, in_f, generator=g) * 0.02
        mix = torch.eye(in_f) + 0.1 * torch.randn(in_f, in_f, generator=g) / in_f**0.5
        h = hessian_from_inputs(torch.randn(4096, in_f, generator=g) @ mix)
        del mix
        for kind in KINDS:
            scheme = default_scheme(kind)
            start = time.perf_counter()
            gptq_quantize(w, h.clone(), scheme, default_options(scheme))
            seconds = time.perf_counter() - start
            rows.append({"linear": name, "shape": [out_f, in_f], "scheme": kind, "seconds": round(seconds, 2)})
            print(f"{name:<14} {out_f:>6} x {in_f:<6} {kind:<5} {seconds:7.2f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "threads": args.threads,
        "machine": f"{os.cpu_count()} CPUs (load average {os.getloadavg()[0]:.1f}), torch {torch.__version__}",
        "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
