"""Which INT4 scheme `compress quantize --int4` writes by default: quality and who loads it.

    python benchmarks/int4_default_choice.py [--eval-tokens 16384] [--dev-tokens 4096]

Every option is quantized as the default pipeline would (GPTQ, act-order, mse observer, then 16
steps of scale tuning on `wikipedia:calib`, 64 x 512 tokens) and scored with transformers'
dequantized load at context 512, stride 256:
- on the calibration dev slice (`wikipedia:calib` after the 64 windows): the default is chosen
  on this figure only, never on evaluation text;
- on `wikipedia:eval` (first ``--eval-tokens`` tokens): the figure reported.
Loaders: plain ``AutoModelForCausalLM.from_pretrained(dir)`` (compressed-tensors' default route,
run on a batch), ``CompressedTensorsConfig(dequantize=True)``, and the layers vLLM's Marlin and
Machete kernels accept (``compress.vllm_compat``). Writes JSON (``--json``).

The rule, fixed before measuring: the default must load with plain ``from_pretrained``; among the
options that do, the lowest dev-slice perplexity wins, unless another is within 1% of it and
vLLM's kernels accept more of its layers, which then wins.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

OPTIONS = {  # name -> (group size, symmetric)
    "sym_g32": (32, True),
    "asym_g32": (32, False),
    "sym_g64": (64, True),
    "asym_g64": (64, False),
}
TUNE_STEPS = 16


def quantize(src: Path, out: Path, group: int, symmetric: bool, calib_ids: torch.Tensor):
    from compress.algorithms.gptq import default_options, with_act_order
    from compress.quantize import quantize_checkpoint
    from compress.scale_tuning import ScaleTuningSpec, tune_scales
    from compress.sequential_quantizer import windows_quantizer
    from foundation.schemes import default_scheme

    scheme = default_scheme("int4").with_options(group_size=group, symmetric=symmetric)
    options = default_options(scheme)
    quantizer = windows_quantizer(src, "gptq", calib_ids, options)
    scheme = with_act_order(scheme)

    def finish(tmp: Path) -> None:
        tune_scales(src, tmp, calib_ids, ScaleTuningSpec(TUNE_STEPS), progress=False)

    return quantize_checkpoint(src, out, scheme, quantizer=quantizer, force=True, progress=False, finish=finish)


def loaders(out: Path, scheme) -> dict:
    from transformers import AutoModelForCausalLM

    from compress.inspection import inspect_checkpoint

    row = {}
    try:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            ok = bool(torch.isfinite(model(torch.arange(16)[None]).logits).all())
        row["plain_from_pretrained"] = "yes" if ok else "loads, non-finite logits"
    except Exception as e:  # noqa: BLE001 - the loader's failure is the measurement
        row["plain_from_pretrained"] = f"no ({type(e).__name__})"
    ins = inspect_checkpoint(out)
    for kernel in ("Marlin", "Machete"):
        ok = sum(any(v.kernel == kernel and v.ok for v in l.verdicts) for l in ins.linears)
        row[f"vllm_{kernel.lower()}_layers"] = f"{ok}/{len(ins.linears)}"
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--dev-tokens", type=int, default=4096)
    ap.add_argument("--only", nargs="+", choices=sorted(OPTIONS), default=list(OPTIONS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from dev_slice import (  # benchmarks/dev_slice.py, beside this script
        dev_perplexity,
        dev_slice,
    )
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        CompressedTensorsConfig,
    )

    from compress.quantize_options import DEFAULT_CALIB_SEQ_LEN, DEFAULT_CALIB_WINDOWS
    from foundation.calibration import CalibrationSpec, calibration_ids
    from foundation.model_source import resolve_model
    from foundation.perplexity import hf_logits_fn, perplexity, tokenize_range

    src = resolve_model("smollm2")
    calib = CalibrationSpec(num_samples=DEFAULT_CALIB_WINDOWS, seq_len=DEFAULT_CALIB_SEQ_LEN)
    calib_ids = calibration_ids(src, calib)
    dev, dev_name = dev_slice(src, calib.num_samples, args.dev_tokens)
    eval_ids = tokenize_range(AutoTokenizer.from_pretrained(src), "wikipedia:eval", max_tokens=args.eval_tokens)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rows = {"original": {"dev": dev_perplexity(base, dev, dev_name),
                         "eval": perplexity(hf_logits_fn(base), eval_ids, "wikipedia:eval").perplexity}}
    del base
    print(f"original: dev {rows['original']['dev']:.3f}, eval {rows['original']['eval']:.3f}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="int4-choice-"))
    try:
        for name in args.only:
            group, symmetric = OPTIONS[name]
            start = time.perf_counter()
            result = quantize(src, work / name, group, symmetric, calib_ids)
            seconds = time.perf_counter() - start
            model = AutoModelForCausalLM.from_pretrained(
                result.out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
            row = {"scheme": result.scheme.describe(), "quantize_seconds": round(seconds, 1),
                   "dev": dev_perplexity(model, dev, dev_name),
                   "eval": perplexity(hf_logits_fn(model), eval_ids, "wikipedia:eval").perplexity,
                   **loaders(result.out, result.scheme)}
            del model
            rows[name] = row
            o = rows["original"]
            print(f"{name}: dev {row['dev']:.3f} ({100 * (row['dev'] / o['dev'] - 1):+.2f}%), eval {row['eval']:.3f} "
                  f"({100 * (row['eval'] / o['eval'] - 1):+.2f}%); plain load {row['plain_from_pretrained']}; "
                  f"Marlin {row['vllm_marlin_layers']}, Machete {row['vllm_machete_layers']}", flush=True)
            shutil.rmtree(result.out, ignore_errors=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({
                    "dev_text": dev_name, "eval_text": f"wikipedia:eval first {eval_ids.numel()} tokens",
                    "calibration": f"{calib.describe()}; GPTQ act-order mse + {TUNE_STEPS} tuning steps",
                    "context": 512, "stride": 256, "rows": rows}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
