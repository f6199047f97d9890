"""Choose GPTQ's sink weight on calibration text only (never on evaluation text).

    python benchmarks/gptq_sink_weight.py [--weights 1,4,16,64] [--samples 64] [--dev-tokens 4096]

For each candidate weight of a calibration window's first token in the Hessians
(``GPTQOptions.sink_weight``), quantize the default model to INT4 (``--int4``'s scheme) by GPTQ on
the first ``--samples`` x 512 tokens of ``wikipedia:calib`` and score perplexity (context 512,
stride 256) on the next ``--dev-tokens`` tokens of ``wikipedia:calib``, which no calibration
window covers. ``wikipedia:eval`` is not read. Writes ``benchmarks/results/gptq_sink_weight.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from compress.algorithms.gptq import GPTQOptions, with_act_order
from compress.calibration import CalibrationSpec
from compress.layer_stream import calibrated_quantizer
from compress.model_source import resolve_model
from compress.quantize import quantize_checkpoint
from compress.schemes import default_scheme
from dev_slice import CALIB, SEQ_LEN, dev_perplexity, dev_slice  # benchmarks/dev_slice.py
from eval.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE

RESULTS = Path(__file__).parent / "results" / "gptq_sink_weight.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="1,4,16,64")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--dev-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--known", default="", help="weight=ppl pairs measured by an earlier run of this script, kept as rows")
    parser.add_argument("--act-order", action="store_true", help="GPTQ with act-order (every run)")
    parser.add_argument("--observer", default="minmax", choices=("minmax", "mse"), help="GPTQ's range observer (every run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    levers = (" act-order" if args.act_order else "") + (f" {args.observer}" if args.observer != "minmax" else "")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = resolve_model("smollm2")
    dev, dev_name = dev_slice(src, args.samples, args.dev_tokens)

    def score(model) -> float:
        return dev_perplexity(model, dev, dev_name)

    rows = {"original": score(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval())}
    print(f"original: {rows['original']:.3f} on {dev_name}", flush=True)
    for pair in filter(None, args.known.split(",")):
        weight, value = pair.split("=")
        rows[f"sink_weight={float(weight):g}"] = float(value)
    calib = CalibrationSpec(CALIB, args.samples, SEQ_LEN)
    with tempfile.TemporaryDirectory(prefix="kvslim-sink-") as work:
        for weight in (float(w) for w in args.weights.split(",")):
            t = time.perf_counter()
            options = GPTQOptions(sink_weight=weight, act_order=args.act_order, observer=args.observer)
            quantizer = calibrated_quantizer(src, "gptq", calib, options)
            scheme = with_act_order(default_scheme("int4")) if args.act_order else default_scheme("int4")
            out = quantize_checkpoint(src, Path(work) / f"w{weight:g}", scheme, quantizer=quantizer,
                                      force=True, progress=False).out
            model = AutoModelForCausalLM.from_pretrained(
                out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
            key = f"sink_weight={weight:g}{levers}"
            rows[key] = score(model)
            print(f"{key}: {rows[key]:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
            best = min((k for k in rows if k != "original"), key=rows.get)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({
                "dev_text": dev_name, "calibration": calib.describe(), "context": DEFAULT_CONTEXT,
                "stride": DEFAULT_STRIDE, "scheme": default_scheme("int4").describe(), "perplexity": rows,
                "best": best, "machine": f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
            }, indent=2) + "\n")
    print(f"best on the dev slice: {best}")


if __name__ == "__main__":
    main()
