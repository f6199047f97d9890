"""How far INT4 GPTQ moves on its own, and which lever moves it further, on calibration text only.

    python benchmarks/gptq_int4_band.py [--levers w0,w64,w128,torch_factor,f64_factor,n128,n256]

Every lever set quantizes the default model with ``--int4``'s scheme and GPTQ's INT4 defaults
(act-order, mse ranges) and is scored by perplexity (context 512, stride 256, fp32) on one fixed
dev slice: ``wikipedia:calib`` tokens [131072, 139264), after the 256 windows of 512 tokens the
largest lever set calibrates on. ``wikipedia:eval`` is not read.

The band (what GPTQ-INT4 gives for equally good inputs): ``w0`` / ``w64`` / ``w128`` (64 windows
starting at window 0 / 64 / 128: three disjoint calibration sets of the default size) and
``torch_factor`` / ``f64_factor`` (windows 0-63, the inverse-Hessian factor by torch's three calls in
fp32 / in float64 instead of LAPACK in place). Levers: ``n128`` / ``n256`` (128 / 256 windows),
``damp0.1`` / ``damp0.001`` (dampening), ``tuned`` /
``tuned_w64`` / ``tuned_w128`` (GPTQ, then 16 steps of scale tuning, ``--tune-scales-steps 16``, on
the same windows), ``n16`` / ``tuned_n16`` (the 16 windows ``make demo`` calibrates on, without / with
16 tuning steps), ``rtn`` (no GPTQ).
Writes ``benchmarks/results/gptq_int4_band.json`` (merging rows of earlier runs; its ``refit*`` rows
are from a lever tried and removed: each row's group scales re-fitted by least squares under the
Hessian's metric after GPTQ).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import compress.algorithms.gptq as gptq
from compress.algorithms.gptq import default_options, with_act_order
from compress.calibration import load_tokenizer
from compress.layer_stream import windows_quantizer
from compress.model_source import resolve_model
from compress.quantize import quantize_checkpoint
from compress.scale_tuning import ScaleTuningSpec, tune_scales
from compress.schemes import default_scheme
from dev_slice import CALIB, SEQ_LEN, dev_perplexity, dev_slice  # benchmarks/dev_slice.py
from eval.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE, tokenize_range

RESULTS = Path(__file__).parent / "results" / "gptq_int4_band.json"
MAX_WINDOWS = 256
DEV_TOKENS = 8192


def _torch_factor(h: torch.Tensor, dampening: float, dtype: torch.dtype) -> torch.Tensor:
    """The factor ``_inverse_hessian_cholesky`` computes, by torch's calls in ``dtype``."""
    x = h.to(dtype)
    x.diagonal().add_(dampening * torch.mean(x.diagonal()))
    inv = torch.cholesky_inverse(torch.linalg.cholesky(x))
    h.copy_(torch.linalg.cholesky(inv, upper=True))
    return h


@dataclass(frozen=True)
class Lever:
    first_window: int = 0
    windows: int = 64
    factor: str = "lapack"  # "lapack" (kvslim's), "torch" (fp32), "float64"
    dampening: float = gptq.DEFAULT_DAMPENING
    gptq: bool = True
    tune_steps: int = 0  # scale tuning after GPTQ (compress.scale_tuning), on the same windows


LEVERS = {
    "rtn": Lever(gptq=False),
    "w0": Lever(),
    "w64": Lever(first_window=64),
    "w128": Lever(first_window=128),
    "torch_factor": Lever(factor="torch"),
    "f64_factor": Lever(factor="float64"),
    "n128": Lever(windows=128),
    "n256": Lever(windows=256),
    "damp0.1": Lever(dampening=0.1),
    "damp0.001": Lever(dampening=0.001),
    "tuned": Lever(tune_steps=16),
    "tuned_w64": Lever(first_window=64, tune_steps=16),
    "tuned_w128": Lever(first_window=128, tune_steps=16),
    "n16": Lever(windows=16),
    "tuned_n16": Lever(windows=16, tune_steps=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levers", default="w0,w64,w128,torch_factor,f64_factor,n128,n256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    unknown = [name for name in args.levers.split(",") if name not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown lever set(s) {', '.join(unknown)}: expected {', '.join(LEVERS)}")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = resolve_model("smollm2")
    dev, dev_name = dev_slice(src, MAX_WINDOWS, DEV_TOKENS)
    stream = tokenize_range(load_tokenizer(src), CALIB, max_tokens=MAX_WINDOWS * SEQ_LEN)
    windows = stream.reshape(MAX_WINDOWS, SEQ_LEN)
    saved = json.loads(args.out.read_text()) if args.out.is_file() else {}
    rows = saved.get("rows", {}) if saved.get("dev_text") == dev_name else {}
    if "original" not in rows:
        rows["original"] = {"perplexity": dev_perplexity(
            AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), dev, dev_name)}
    base = rows["original"]["perplexity"]
    print(f"original: {base:.3f} on {dev_name}", flush=True)
    scheme = default_scheme("int4")
    lapack_factor = gptq._inverse_hessian_cholesky
    with tempfile.TemporaryDirectory(prefix="kvslim-band-") as work:
        for name in args.levers.split(","):
            lever = LEVERS[name]
            t = time.perf_counter()
            quantizer, lever_scheme = None, scheme
            if lever.gptq:
                options = replace(default_options(scheme), dampening=lever.dampening)
                lever_scheme = with_act_order(scheme) if options.act_order else scheme
                ids = windows[lever.first_window : lever.first_window + lever.windows].clone()
                quantizer = windows_quantizer(src, "gptq", ids, options)
            finish = None
            if lever.tune_steps:
                def finish(tmp: Path, ids=ids, steps=lever.tune_steps) -> None:
                    tune_scales(src, tmp, ids, ScaleTuningSpec(steps), progress=False)
            if lever.factor != "lapack":
                dtype = torch.float64 if lever.factor == "float64" else torch.float32
                gptq._inverse_hessian_cholesky = lambda h, d, dtype=dtype: _torch_factor(h, d, dtype)
            try:
                out = quantize_checkpoint(src, Path(work) / name, lever_scheme, quantizer=quantizer,
                                          force=True, progress=False, finish=finish).out
            finally:
                gptq._inverse_hessian_cholesky = lapack_factor
            seconds = time.perf_counter() - t
            model = AutoModelForCausalLM.from_pretrained(
                out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
            ppl = dev_perplexity(model, dev, dev_name)
            rows[name] = {"perplexity": ppl, "vs_original_percent": round((ppl / base - 1) * 100, 3),
                          "quantize_seconds": round(seconds, 1),
                          "calibration": f"windows [{lever.first_window}, {lever.first_window + lever.windows}) "
                                         f"of {SEQ_LEN} tokens" if lever.gptq else None,
                          "factor": lever.factor, "dampening": lever.dampening, "tune_steps": lever.tune_steps}
            print(f"{name}: {ppl:.3f} ({rows[name]['vs_original_percent']:+.2f}%, quantize {seconds:.0f} s)", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({
                "dev_text": dev_name, "calibration_text": CALIB, "context": DEFAULT_CONTEXT, "stride": DEFAULT_STRIDE,
                "scheme": scheme.describe(), "gptq_options": repr(default_options(scheme)), "rows": rows,
                "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
            }, indent=2) + "\n")


if __name__ == "__main__":
    main()
