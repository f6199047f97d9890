"""Runtime core: forward latency and resident weight bytes per linear path, vs transformers.

For the default model (SmolLM2-135M) as fp32 / bf16 dense and quantized (W8A16, INT4 default,
FP8_DYNAMIC), with torch's CPU weight-only kernels (bf16) and with dequantize-per-forward:

- ``prefill_ms``: one 256-token prompt (real text, ``wikipedia:eval``), one forward through the
  engine's paged cache, logits of every position (as transformers' ``model(ids)``);
- ``decode_ms@B``: one engine step decoding B sequences (each with 64 cached tokens): flattened
  batch, paged cache, sampling (median of 5);
- ``weights_MiB``: resident weight bytes measured from the live tensors.

transformers rows: the same model, ``model(ids)`` for prefill and one cached decode step on a
batch of B equal-length rows. Single runs on a shared, noisy 2-core machine: read ratios, not
absolute numbers.

    python benchmarks/runtime_linear_paths.py --json benchmarks/results/runtime_linear_paths.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

BATCHES = (1, 8, 32)
PROMPT = 256
CONTEXT = 64
REPS = 5


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def quantized_checkpoint(source: Path, name: str) -> Path:
    from compress.quantize import quantize_checkpoint
    from foundation.model_source import cache_root
    from foundation.schemes import PRESETS, default_scheme

    scheme = default_scheme("int4") if name == "INT4_DEFAULT" else PRESETS[name]
    out = cache_root() / "bench-runtime" / scheme.name / (str(scheme.group_size) if scheme.group_size else "channel")
    if not (out / "config.json").is_file():
        quantize_checkpoint(source, out, scheme, progress=False, force=True)
    return out


@torch.inference_mode()
def bench_runtime(path: Path, dtype: str, kernels: bool, ids: list[int]) -> dict:
    """Prefill of PROMPT tokens, and one engine decode step at each batch of CONTEXT-token sequences."""
    from runtime.engine.engine import Engine
    from runtime.engine.sampling import SamplingParams
    from runtime.model.loader import live_weight_bytes, load_model

    model = load_model(path, dtype, use_cpu_kernels=kernels)
    row = {"weights_MiB": live_weight_bytes(model) / 2**20}
    scorer = Engine.sized_for(model, PROMPT, 1, max_num_batched_tokens=PROMPT)
    row["prefill_ms"] = _timed(lambda: scorer.score(ids[:PROMPT]), 2)
    for b in BATCHES:
        engine = Engine.sized_for(model, CONTEXT + REPS + 8, b, max_num_seqs=b, max_num_batched_tokens=b * CONTEXT,
                                  enable_prefix_caching=False)
        params = SamplingParams(temperature=0, max_tokens=REPS + 4, ignore_eos=True)
        for s in range(b):
            engine.add_request(ids[s:s + CONTEXT], params)
        engine.step()  # every prompt prefilled, first tokens sampled
        row[f"decode_ms@{b}"] = _timed(engine.step, REPS)
    return row


@torch.inference_mode()
def bench_hf(path: Path, dtype: str, ids: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    row = {"weights_MiB": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    row["prefill_ms"] = _timed(lambda: model(torch.tensor([ids[:PROMPT]]), logits_to_keep=1), 2)
    for b in BATCHES:
        batch = torch.tensor([ids[s:s + CONTEXT] for s in range(b)])
        past = model(batch, use_cache=True).past_key_values
        nxt = torch.tensor([[ids[s]] for s in range(b)])

        def step():
            model(nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
            past.crop(-1)  # drop the step just added

        row[f"decode_ms@{b}"] = _timed(step, REPS)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from foundation.model_source import resolve_model
    from foundation.perplexity import tokenize_range

    base = resolve_model("smollm2")
    ids = tokenize_range(AutoTokenizer.from_pretrained(base), "wikipedia:eval", max_tokens=PROMPT + 64).tolist()
    runs = [("transformers", base, "float32", None), ("transformers", base, "bfloat16", None),
            ("kvslim", base, "float32", True), ("kvslim", base, "bfloat16", True)]
    for name in ("W8A16", "INT4_DEFAULT", "FP8_DYNAMIC"):
        q = quantized_checkpoint(base, name)
        runs += [(f"kvslim {name}", q, "bfloat16", True), (f"kvslim {name}", q, "bfloat16", False),
                 (f"kvslim {name}", q, "float32", False)]
    seen = set()
    rows = []
    for who, path, dtype, kernels in runs:
        if who != "transformers" and (who, dtype, kernels) in seen:
            continue
        seen.add((who, dtype, kernels))
        row = bench_hf(path, dtype, ids) if who == "transformers" else bench_runtime(path, dtype, kernels, ids)
        path_name = "-" if kernels is None else ("cpu kernels" if kernels else "dequantize")
        rows.append({"runtime": who, "dtype": dtype, "linear": path_name, **row})
        print(json.dumps(rows[-1]), flush=True)
    cols = ["runtime", "dtype", "linear", "weights_MiB", "prefill_ms"] + [f"decode_ms@{b}" for b in BATCHES]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "prompt": PROMPT, "context": CONTEXT,
                                         "text": "wikipedia:eval", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
