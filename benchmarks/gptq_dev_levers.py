"""Choose GPTQ levers for one scheme on calibration text only (never on evaluation text).

    python benchmarks/gptq_dev_levers.py --kind fp8 [--levers rtn,plain,served] [--samples 64] [--dev-tokens 4096]

Each lever set quantizes the default model by GPTQ on the first ``--samples`` x 512 tokens of
``wikipedia:calib`` and is scored by perplexity (context 512, stride 256, fp32) on the next
``--dev-tokens`` tokens of ``wikipedia:calib``, which no calibration window covers; schemes that
quantize activations are scored as served (transformers' default compressed-tensors route
fake-quantizes every quantized Linear's input). ``wikipedia:eval`` is not read.

Lever sets: ``rtn`` (no GPTQ, the reference); ``plain`` (GPTQ on unquantized inputs: kvslim's
GPTQ before the scheme's activation quantization was applied while calibrating); ``served`` (the
scheme's activation quantization applied while calibrating, what ``compress quantize`` does);
the scheme's GPTQ defaults (``default_options``) otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from compress.algorithms.gptq import default_options, with_act_order
from compress.calibration import CalibrationSpec
from compress.layer_stream import calibrated_quantizer
from compress.model_source import resolve_model
from compress.quantize import quantize_checkpoint
from compress.schemes import default_scheme
from dev_slice import CALIB, SEQ_LEN, dev_perplexity, dev_slice  # benchmarks/dev_slice.py
from eval.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE

LEVERS = ("rtn", "plain", "served")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="fp8", choices=("fp8", "w8a8", "int8", "int4"))
    parser.add_argument("--levers", default="rtn,plain,served")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--dev-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON (default benchmarks/results/gptq_dev_levers_KIND.json)")
    args = parser.parse_args()
    out_path = args.out or Path(__file__).parent / "results" / f"gptq_dev_levers_{args.kind}.json"
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = resolve_model("smollm2")
    dev, dev_name = dev_slice(src, args.samples, args.dev_tokens)

    def score(model) -> float:
        return dev_perplexity(model, dev, dev_name)

    scheme = default_scheme(args.kind)
    served = scheme.input_activations is not None
    rows = {"original": {"perplexity": score(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())}}
    print(f"original: {rows['original']['perplexity']:.3f} on {dev_name}", flush=True)
    calib = CalibrationSpec(CALIB, args.samples, SEQ_LEN)
    with tempfile.TemporaryDirectory(prefix="kvslim-levers-") as work:
        for lever in args.levers.split(","):
            if lever not in LEVERS:
                raise SystemExit(f"unknown lever set {lever!r}: expected one of {', '.join(LEVERS)}")
            t = time.perf_counter()
            options = default_options(scheme)
            lever_scheme = with_act_order(scheme) if options.act_order else scheme
            quantizer = None
            if lever != "rtn":
                acts = scheme.input_activations if lever == "served" else None
                quantizer = calibrated_quantizer(src, "gptq", calib, options, activations=acts)
            out = quantize_checkpoint(src, Path(work) / lever, lever_scheme, quantizer=quantizer,
                                      force=True, progress=False).out
            seconds = time.perf_counter() - t
            load = {} if served else {"quantization_config": CompressedTensorsConfig(dequantize=True)}
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **load).eval()
            rows[lever] = {"perplexity": score(model), "quantize_seconds": round(seconds, 1)}
            base = rows["original"]["perplexity"]
            rows[lever]["vs_original_percent"] = round((rows[lever]["perplexity"] / base - 1) * 100, 3)
            print(f"{lever}: {rows[lever]['perplexity']:.3f} ({rows[lever]['vs_original_percent']:+.2f}%, "
                  f"quantize {seconds:.0f} s)", flush=True)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps({
                "dev_text": dev_name, "calibration": calib.describe(), "context": DEFAULT_CONTEXT,
                "stride": DEFAULT_STRIDE, "scheme": scheme.describe(), "scored_as_served": served, "rows": rows,
                "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
            }, indent=2) + "\n")


if __name__ == "__main__":
    main()
