"""`compress report` over every variant of the default model: the table and plot in BENCHMARKS.md.

    python benchmarks/report_variants.py [--healed out/healed] [--demo out/demo]

Reuses what earlier runs wrote: ``make demo`` (FP8 + FP8 KV, INT4 GPTQ under ``--demo``) and
``benchmarks/heal_curve.py --keep out/healed`` (MQA, kv-share 2 and both, healed 20 CPU-minutes).
Builds the cheap rest here (INT8 and INT4 by RTN; hybrid sliding window with calibrated global
layers, unhealed), then runs ``compress report`` on all of them with the demo's task set and
limits, and copies the table, plot and JSON to ``benchmarks/results/report_variants.*``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

from compress.demo import LIMIT, MODEL, PPL_TOKENS, TASKS  # noqa: E402

OUT = Path("out/variants")
RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="out/demo", help="`make demo`'s output directory")
    parser.add_argument("--healed", default="out/healed", help="heal_curve.py --keep directory")
    parser.add_argument("--combined", default=None,
                        help="MQA + kv-share 2 checkpoint (default: the healed one under --healed; "
                             "e.g. the demo's 20-step heal, out/demo/smollm2-mqa-kv2)")
    parser.add_argument("--combined-name", default="mqa+kv-share2 (heal 20m)")
    args = parser.parse_args()
    from compress.cli import main as compress

    demo, healed = Path(args.demo), Path(args.healed)
    int8, int4, hybrid = (str(OUT / n) for n in ("smollm2-int8", "smollm2-int4-rtn", "smollm2-sliding256"))
    builds = [
        ["quantize", MODEL, "--int8", "-o", int8, "--force"],
        ["quantize", MODEL, "--int4", "-o", int4, "--force"],
        ["convert", MODEL, "--sliding-window", "256", "--global-every", "6", "--global-select", "calib",
         "--eval-tokens", "0", "-o", hybrid, "--force"],
    ]
    rows = [
        ("original", MODEL), ("fp8+fp8kv", demo / "smollm2-fp8"), ("int8", int8), ("int4-rtn", int4),
        ("int4-gptq", demo / "smollm2-int4-gptq"), ("mqa (heal 20m)", healed / "healed-mqa"),
        ("kv-share2 (heal 20m)", healed / "healed-kv-share2"),
        (args.combined_name, Path(args.combined) if args.combined else healed / "healed-mqa-kv-share2"),
        ("sliding256 (unhealed)", hybrid),
    ]
    missing = [str(p) for _, p in rows if p != MODEL and not str(p).startswith(str(OUT)) and not Path(p).is_dir()]
    if missing:
        print(f"report_variants: missing {', '.join(missing)}: run `make demo` and "
              f"`python benchmarks/heal_curve.py --keep {healed}` first", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    for argv in builds:
        print(f"$ compress {' '.join(argv)}", flush=True)
        if compress(argv) != 0:
            return 1
    report = OUT / "report"
    argv = ["report", *(str(p) for _, p in rows), "--names", ",".join(n for n, _ in rows), "--tasks", TASKS,
            "--limit", str(LIMIT), "--ppl-tokens", str(PPL_TOKENS), "-o", str(report), "--force"]
    print(f"$ compress {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    if compress(argv) != 0:
        return 1
    print(f"report: {time.perf_counter() - start:.0f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "report.png", "report.json"):
        shutil.copyfile(report / name, RESULTS / f"report_variants{Path(name).suffix}")
    print((report / "report.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
