"""Where FP8_DYNAMIC's per-token activation quantization costs, on calibration text only.

    python benchmarks/fp8_activation_sensitivity.py [--dev-tokens 4096] [--threads 2]

The original fp32 weights; FP8 per-token quantize-dequantize (``fake_quantize_fp8_per_token``,
what FP8_DYNAMIC serves) applied to the inputs of one Linear kind at a time, then all of them,
then all of them with E4M3's 3-bit mantissa rounding but no exponent floor (no subnormal loss:
what is left if activation/weight smoothing fixed every magnitude problem). Scored by perplexity
on the calibration dev slice (``benchmarks/dev_slice.py``); ``wikipedia:eval`` is not read.
Writes ``benchmarks/results/fp8_activation_sensitivity.json``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch

from compress.activation_quant import FP8_MAX, LinearInputQuantizer, fake_quantize_fp8_per_token, quantize_fp8_per_token
from compress.model_source import resolve_model
from compress.quantize import PROJECTIONS
from dev_slice import dev_perplexity, dev_slice  # benchmarks/dev_slice.py

RESULTS = Path(__file__).parent / "results" / "fp8_activation_sensitivity.json"
KINDS = {"q/k/v": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate/up": ("gate_proj", "up_proj"),
         "down": ("down_proj",), "all": PROJECTIONS}


def mantissa_only_per_token(x: torch.Tensor) -> torch.Tensor:
    """Per-token scale to 448, then E4M3's 3-bit mantissa rounding with no exponent floor."""
    _, scale = quantize_fp8_per_token(x)
    mantissa, exponent = torch.frexp(x.float() / scale)
    rounded = torch.ldexp(torch.round(mantissa * 16) / 16, exponent)
    return (rounded.clamp(-FP8_MAX, FP8_MAX) * scale).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64, help="calibration windows the dev slice follows")
    parser.add_argument("--dev-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    src = resolve_model("smollm2")
    dev, dev_name = dev_slice(src, args.samples, args.dev_tokens)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    @torch.no_grad()
    def score(kinds: tuple[str, ...], quantizer: Callable[[torch.Tensor], torch.Tensor] | None) -> float:
        if quantizer is None:
            return dev_perplexity(model, dev, dev_name)
        with LinearInputQuantizer(model, quantizer, select=lambda name: name.split(".")[-1] in kinds):
            return dev_perplexity(model, dev, dev_name)

    base = score((), None)
    rows = {"original": {"perplexity": base}}
    for label, kinds in KINDS.items():
        rows[f"fp8 {label}"] = {"perplexity": score(kinds, fake_quantize_fp8_per_token)}
    rows["mantissa-only all"] = {"perplexity": score(PROJECTIONS, mantissa_only_per_token)}
    print(f"perplexity on {dev_name} (context 512, stride 256), original weights (fp32)")
    for key, r in rows.items():
        r["vs_original_pct"] = (r["perplexity"] / base - 1) * 100
        print(f"{key:<20} {r['perplexity']:8.4f} {r['vs_original_pct']:+7.2f}%")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"text": dev_name, "threads": args.threads, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
