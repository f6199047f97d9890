"""Weight quantization quality on the default model: perplexity and the time each took.

    python benchmarks/quant_quality.py [--max-tokens 16384] [--only fp8,int4_g64_asym]

Perplexity: ``foundation.perplexity.perplexity`` (fp32, context 512, stride 256) on the first
``--max-tokens`` tokens of ``wikipedia:eval``. Our checkpoints are written by
``compress.quantize.quantize_checkpoint`` (RTN) and evaluated by loading them in transformers
through compressed-tensors, decompressed at load (``CompressedTensorsConfig(dequantize=True)``),
so the figures do not depend on kvslim's runtime. Peer: bitsandbytes NF4 (blocksize 64, fp32
compute; ``pip install bitsandbytes``), quantized by transformers at load time.

Writes ``benchmarks/results/quant_quality.json`` and prints a table. Timings are wall-clock on a
shared, noisy 2-core machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from compress.quantize import quantize_checkpoint
from compress.summary import totals
from foundation.model_source import resolve_model
from foundation.perplexity import (
    DEFAULT_CONTEXT,
    DEFAULT_STRIDE,
    hf_logits_fn,
    perplexity,
    tokenize_range,
)
from foundation.schemes import FP8_DYNAMIC, W4A16, W8A16, QuantScheme

TEXT = "wikipedia:eval"
RESULTS = Path(__file__).parent / "results" / "quant_quality.json"

OURS: dict[str, QuantScheme] = {
    "fp8": FP8_DYNAMIC,
    "int8": W8A16,
    "int4_g32_sym": W4A16.with_options(group_size=32, symmetric=True),
    "int4_g32_asym": W4A16.with_options(group_size=32, symmetric=False),
    "int4_g64_sym": W4A16.with_options(group_size=64, symmetric=True),
    "int4_g64_asym": W4A16.with_options(group_size=64, symmetric=False),
}


def _ppl(model, ids: torch.Tensor) -> dict:
    start = time.perf_counter()
    res = perplexity(hf_logits_fn(model), ids, TEXT, DEFAULT_CONTEXT, DEFAULT_STRIDE, progress=True)
    return {"perplexity": res.perplexity, "eval_tokens": res.num_tokens, "scored": res.num_scored,
            "eval_seconds": time.perf_counter() - start}


def run_original(src: Path, ids: torch.Tensor) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    return {"method": "original (dequantized Q4_1 GGUF, fp32)", "quantize_seconds": 0.0,
            "bytes": sum(f.stat().st_size for f in src.glob("*.safetensors")), "bytes_bf16": params * 2, **_ppl(model, ids)}


def run_ours(name: str, scheme: QuantScheme, src: Path, ids: torch.Tensor, work: Path) -> dict:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = work / name
    result = quantize_checkpoint(src, out, scheme, force=True, progress=False)
    t = totals(result.stats)
    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
    row = {"method": f"kvslim RTN {scheme.describe()}", "quantize_seconds": result.seconds,
           "bytes": t["bytes_after"], "bytes_bf16": t["bytes_bf16"],
           "quantized_linear_ratio_vs_bf16": t["quantized_ratio_vs_bf16"],
           "weight_mean_abs_error": t["mean_abs_error"], **_ppl(model, ids)}
    shutil.rmtree(out, ignore_errors=True)
    return row


def run_nf4(src: Path, ids: torch.Tensor) -> dict:
    try:
        bnb_version = version("bitsandbytes")
    except PackageNotFoundError:
        return {"method": "bitsandbytes NF4", "skipped": "bitsandbytes is not installed (pip install bitsandbytes)"}
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, dtype=torch.float32,
                                                 device_map="cpu").eval()
    seconds = time.perf_counter() - start
    return {"method": f"bitsandbytes {bnb_version} NF4 (blocksize 64, fp32 compute, CPU)",
            "quantize_seconds": seconds, "quantize_note": "load + quantize in from_pretrained",
            "bytes": model.get_memory_footprint(), "bytes_note": "in-memory footprint (get_memory_footprint)",
            **_ppl(model, ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--only", default=None, help="comma-separated subset: original,nf4," + ",".join(OURS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    src = resolve_model("smollm2")
    ids = tokenize_range(AutoTokenizer.from_pretrained(src), TEXT, max_tokens=args.max_tokens)
    wanted = args.only.split(",") if args.only else ["original", *OURS, "nf4"]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvslim-qq-") as work:
        for key in wanted:
            print(f"== {key}", flush=True)
            if key == "original":
                rows[key] = run_original(src, ids)
            elif key == "nf4":
                rows[key] = run_nf4(src, ids)
            else:
                rows[key] = run_ours(key, OURS[key], src, ids, Path(work))
            gc.collect()
            _report(rows, args.max_tokens)
    _report(rows, args.max_tokens, final=True)


def _report(rows: dict[str, dict], max_tokens: int, final: bool = False) -> None:
    base = rows.get("original", {}).get("perplexity")
    print(f"\nperplexity on {TEXT}, first {max_tokens} tokens, context {DEFAULT_CONTEXT}, stride {DEFAULT_STRIDE}, fp32")
    print(f"{'variant':<16} {'ppl':>8} {'vs orig':>8} {'MiB':>8} {'x vs bf16':>9} {'quantize s':>10} {'eval s':>7}")
    for key, r in rows.items():
        if "skipped" in r:
            print(f"{key:<16} skipped: {r['skipped']}")
            continue
        delta = f"{(r['perplexity'] / base - 1) * 100:+.1f}%" if base else "-"
        ratio = f"{r['bytes_bf16'] / r['bytes']:.2f}" if r.get("bytes_bf16") else "-"
        print(f"{key:<16} {r['perplexity']:8.3f} {delta:>8} {r['bytes'] / 2**20:8.1f} {ratio:>9} "
              f"{r['quantize_seconds']:10.1f} {r['eval_seconds']:7.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "text": TEXT, "max_tokens": max_tokens, "context": DEFAULT_CONTEXT, "stride": DEFAULT_STRIDE,
        "model": "SmolLM2-135M-Instruct (dequantized Q4_1 GGUF), fp32",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs shared with other jobs "
                   f"(load average {os.getloadavg()[0]:.1f} at write), torch {torch.__version__}",
        "complete": final, "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
