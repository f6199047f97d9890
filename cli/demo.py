"""`python -m cli.demo` (what `make demo` runs): the main job end to end on the default model.

SmolLM2-135M-Instruct is quantized (FP8 weights + calibrated FP8 KV cache; INT4 by GPTQ with its
scales then tuned end to end; the unquantized tensors stored in bf16, since the default model's own
dtype is the GGUF's fp32), rewritten (MQA + KV shared by pairs of layers) and briefly healed, given
a KV plan (INT4 KV with a sliding window + sinks and full layers or full KV heads chosen under 16% of
the bf16 KV bytes at context 2,048, each candidate served on a calibration dev slice, bounded by
calibration retrieval), then every checkpoint is evaluated on kvslim's own runtime (lm-eval through
the ``kvslim`` backend, small fixed limits; perplexity and passkey retrieval at context 2,048) and
compared by ``compress report``: bytes, KV capacity, quality, retrieval, decode speed. Outputs go to
``./out/demo`` (overwritten: it is a demo). Each stage prints the command it runs and its wall time.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

# OpenMP workers that spin-wait make 2 threads 10-30x slower as soon as anything else runs on the
# cores; sleeping waits cost little on an idle machine. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

OUT = Path("out/demo")
MODEL = "smollm2"
TASKS = "arc_easy,hellaswag,piqa,ppl_wikipedia,passkey"  # passkey: retrieval of a fact stated once, at CONTEXT
# Small fixed sizes, so the demo stays within ~20 minutes on 2 idle cores (BENCHMARKS.md has the stage times).
LIMIT = 24  # docs per lm-eval task
CONTEXT = 2048  # KV bytes and perplexity at the same context (a window of 1,024 saves nothing below it)
PPL_TOKENS = 4 * CONTEXT  # wikipedia:eval tokens: every row scored over several full contexts
HEAL_STEPS = 20  # x 4 x 256 tokens of wikipedia:heal
KV_CALIB_SAMPLES = 8  # x 512 tokens of wikipedia:calib for the FP8 KV scales
GPTQ_CALIB_SAMPLES = 16  # x 512 tokens of wikipedia:calib for GPTQ's Hessians and the scale tuning
TUNE_SCALES_STEPS = 6  # x 4 windows: the INT4 scales tuned end to end after GPTQ (compress/scale_tuning.py)
KV_BUDGET = 0.16  # the KV plan's budget: >= 6x fewer KV bytes per token than bf16 (eval/kv_plan.py)
# The plan's KV dtype: int4, what every full search at this budget chose (dev slice, served: int4 with 54 / 46
# heads streaming over 512 / 256 +1.68% / +3.10%; int8 with 85 / 73 heads +3.14% / +3.67%; bf16 with 88
# heads +6.29%; int2 at any window +24% to +26% with its first block quantized, and int2 with it exact
# +11.7% over full attention alone);
# searching bf16 / int8 / int2 too takes the demo's plan stage from ~7 to ~18 minutes.
PLAN_KV_DTYPES = ("int4",)


def stages() -> list[tuple[str, list[str]]]:
    """(banner, compress argv) per stage, in order."""
    fp8, int4, mqa, plan = (str(OUT / n) for n in ("smollm2-fp8", "smollm2-int4-gptq", "smollm2-mqa-kv2",
                                                   "smollm2-kv-plan"))
    eval_args = ["--backend", "kvslim", "--tasks", TASKS, "--limit", str(LIMIT), "--ppl-tokens", str(PPL_TOKENS),
                 "--ctx", str(CONTEXT), "--retrieval-contexts", str(CONTEXT)]
    return [
        ("quantize: FP8 weights + calibrated FP8 KV cache",
         ["quantize", MODEL, "--fp8", "--kv-cache-fp8", "--dtype", "bfloat16", "--num-calib-samples", str(KV_CALIB_SAMPLES), "-o", fp8, "--force"]),
        ("quantize: INT4 weights by GPTQ (act-order, mse ranges: its defaults for INT4), then scale tuning",
         ["quantize", MODEL, "--int4", "--dtype", "bfloat16", "--method", "gptq", "--num-calib-samples", str(GPTQ_CALIB_SAMPLES),
          "--tune-scales-steps", str(TUNE_SCALES_STEPS), "-o", int4, "--force"]),
        (f"convert: MQA + KV shared by pairs of layers, healed {HEAL_STEPS} steps",
         ["convert", MODEL, "--mqa", "--kv-share", "2", "--heal-steps", str(HEAL_STEPS), "--eval-tokens", "0",
          "-o", mqa, "--force"]),
        (f"convert: KV plan under {KV_BUDGET:g} of the bf16 KV bytes at context 2,048 (served on a dev slice, "
         "bounded by calibration retrieval)",
         ["convert", MODEL, "--kv-budget", str(KV_BUDGET), "--kv-dtypes", *PLAN_KV_DTYPES, "-o", plan, "--force"]),
        *[(f"eval on the kvslim runtime: {Path(c).name}", ["eval", c, *eval_args])
          for c in (MODEL, fp8, int4, mqa, plan)],
        ("report",
         ["report", MODEL, fp8, int4, mqa, plan, "--names", "original,fp8+fp8kv,int4-gptq,mqa+kv-share2,kv-plan",
          "--tasks", TASKS, "--limit", str(LIMIT), "--ppl-tokens", str(PPL_TOKENS), "--ctx", str(CONTEXT),
          "-o", str(OUT / "report"), "--force"]),
    ]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    import torch

    from cli.main import main as compress

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    OUT.mkdir(parents=True, exist_ok=True)
    timings = []
    start = time.perf_counter()
    for i, (title, argv) in enumerate(stages(), 1):
        print(f"\n=== [{i}/{len(stages())}] {title}\n$ compress {' '.join(argv)}", flush=True)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        code = compress(argv)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
        timings.append((title, seconds, cpu))
        print(f"=== [{i}] {title}: {seconds:,.0f} s wall, {cpu:,.0f} s CPU", flush=True)
        if code != 0:
            print(f"demo: stage failed with exit code {code}", file=sys.stderr)
            return code
    print(f"\nstage times ({(time.perf_counter() - start) / 60:.1f} min wall in all; CPU seconds / 2 is the wall time on 2 idle cores):")
    for title, seconds, cpu in timings:
        print(f"  {seconds:7,.0f} s wall {cpu:7,.0f} s CPU  {title}")
    print()
    print((OUT / "report" / "report.md").read_text())
    print(f"table: {OUT / 'report' / 'report.md'}\nplot:  {OUT / 'report' / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
