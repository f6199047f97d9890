"""SmoothQuant (`compress quantize --smooth ALPHA`) before W8A8 / FP8_DYNAMIC, RTN and GPTQ.

Alpha is chosen on the calibration dev slice (``wikipedia:calib`` after the calibration windows,
``dev_slice.py``); every alpha is also scored on evaluation text (the first ``--max-tokens`` of
``wikipedia:eval``), reported beside the choice, never read by it. Activation statistics, GPTQ and the smoothing
all read the same calibration windows (``--samples`` x 512 tokens of ``wikipedia:calib``).
Perplexity through transformers' compressed-tensors loading (activations quantized as served).

    python benchmarks/smoothquant_quality.py --json benchmarks/results/smoothquant_quality.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dev_slice import CALIB, SEQ_LEN, dev_perplexity, dev_slice

ALPHAS = (0.5, 0.65, 0.8, 0.9)
EVAL_TEXT = "wikipedia:eval"


def quantize(ckpt, kind: str, method: str, ids: torch.Tensor, out: Path) -> Path:
    from compress.algorithms.gptq import default_options
    from compress.layer_stream import windows_quantizer
    from compress.quantize import quantize_checkpoint
    from compress.schemes import default_scheme

    scheme = default_scheme(kind)
    quantizer = None
    if method == "gptq":  # as `compress quantize --method gptq` does: inputs quantized as served
        quantizer = windows_quantizer(ckpt, "gptq", ids, default_options(scheme), activations=scheme.input_activations)
    return quantize_checkpoint(ckpt, out, scheme, quantizer=quantizer, force=True, progress=False).out


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main() -> None:
    from transformers import AutoTokenizer

    from compress.calibration import CalibrationSpec, calibration_ids
    from compress.checkpoint import Checkpoint
    from compress.model_source import resolve_model
    from compress.smoothing import input_maxima, smoothed
    from compress.smoothing_spec import SmoothingSpec
    from eval.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE, hf_logits_fn, perplexity, tokenize_range

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kinds", nargs="+", default=["w8a8", "fp8"])
    ap.add_argument("--methods", nargs="+", default=["rtn", "gptq"])
    ap.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS))
    ap.add_argument("--samples", type=int, default=64, help="calibration windows of 512 tokens")
    ap.add_argument("--dev-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    src = resolve_model(args.model)
    ckpt = Checkpoint.open(src)
    calib = CalibrationSpec(CALIB, args.samples, SEQ_LEN)
    ids = calibration_ids(src, calib)
    dev_ids, dev_name = dev_slice(src, args.samples, args.dev_tokens)
    evaluation = tokenize_range(AutoTokenizer.from_pretrained(src), EVAL_TEXT, max_tokens=args.max_tokens)
    eval_name = f"{EVAL_TEXT} first {evaluation.numel()} tokens"

    def eval_ppl(model) -> float:
        return perplexity(hf_logits_fn(model), evaluation, eval_name, DEFAULT_CONTEXT, DEFAULT_STRIDE,
                          progress=False).perplexity

    original = load(src)
    base = {"dev": dev_perplexity(original, dev_ids, dev_name), "eval": eval_ppl(original)}
    del original
    start = time.perf_counter()
    maxima = input_maxima(ckpt, ids)
    stats_seconds = time.perf_counter() - start
    rows = []
    work = Path(tempfile.mkdtemp(prefix="smoothquant-"))
    try:
        for kind in args.kinds:
            for method in args.methods:
                dev, evals = {}, {}
                for alpha in [None, *args.alphas]:
                    source = ckpt if alpha is None else smoothed(ckpt, maxima, SmoothingSpec(alpha))[0]
                    out = quantize(source, kind, method, ids, work / f"{kind}-{method}-{alpha}")
                    model = load(out)
                    dev[alpha] = dev_perplexity(model, dev_ids, dev_name)
                    evals[alpha] = eval_ppl(model)  # recorded for every alpha; the choice reads dev only
                    del model
                    shutil.rmtree(out)
                    print(f"{kind} {method} alpha {alpha}: dev {dev[alpha]:.3f} ({dev[alpha] / base['dev'] - 1:+.2%}), "
                          f"eval {evals[alpha]:.3f} ({evals[alpha] / base['eval'] - 1:+.2%})", flush=True)
                chosen = min(args.alphas, key=lambda a: dev[a])
                rows.append({"kind": kind, "method": method, "chosen_alpha": chosen,
                             "dev": {str(a): round(p, 4) for a, p in dev.items()},
                             "eval": {str(a): round(p, 4) for a, p in evals.items()}})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nSmoothQuant, {args.model}; alpha chosen on {dev_name} (original {base['dev']:.3f}); "
          f"evaluated on {eval_name} (original {base['eval']:.3f}); context {DEFAULT_CONTEXT}, stride "
          f"{DEFAULT_STRIDE}; statistics and GPTQ on {calib.describe()} ({stats_seconds:.0f} s for the statistics)")
    alphas = [None, *args.alphas]
    print(f"{'scheme':8} {'method':6} {'text':5} " + " ".join(f"{'a=' + str(a):>8}" for a in alphas) + "  chosen on dev")
    for r in rows:
        for text in ("dev", "eval"):
            cells = " ".join(f"{r[text][str(a)] / base[text] - 1:>+8.2%}" for a in alphas)
            print(f"{r['kind']:8} {r['method']:6} {text:5} {cells}  {r['chosen_alpha']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "dev_text": dev_name, "eval_text": eval_name, "calibration": calib.describe(),
            "context": DEFAULT_CONTEXT, "stride": DEFAULT_STRIDE, "original": base,
            "statistics_seconds": round(stats_seconds, 1), "rows": rows,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
