"""Perplexity through the engine's paged cache at each KV dtype (the shared perplexity function).

Logits come from ``Engine.score``: each window runs through the paged cache, so quantized K/V is
written and read back exactly as when serving. Weights fp32 (the default model's dequantized GGUF).
``fp8_e4m3`` uses per-token-and-head scales; ``fp8_e4m3:calibrated`` the per-layer static scales
that ``compress quantize --kv-cache-fp8`` writes, calibrated by the same code on ``--calib``. Packed
KV's variants are KV dtype names too (``int4:keys-unrotated``: ``foundation.kv_dtype_mix``).

    python benchmarks/engine_kv_perplexity.py --tokens 4096 --json runs/engine_kv_ppl.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="wikipedia:eval",
                    help="a named text range, or 'dev': the calibration dev slice (wikipedia:calib after 64 x 512 tokens)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8_e4m3", "fp8_e4m3:calibrated", "int8"])
    ap.add_argument("--ctx", type=int, default=512, help="scored window (stride half of it)")
    ap.add_argument("--calib-samples", type=int, default=64, help="calibration windows of 512 tokens")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    from foundation.model_source import resolve_model
    from foundation.perplexity import perplexity, tokenize_range
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import load_model

    path = resolve_model(args.model)
    if args.text == "dev":
        from dev_slice import dev_slice

        ids, args.text = dev_slice(path, 64, args.tokens)
    else:
        ids = tokenize_range(AutoTokenizer.from_pretrained(path), args.text, max_tokens=args.tokens)
    model = load_model(path, "float32")
    results = {}
    for kv in args.kv_dtypes:
        variant, calibrated = kv.removesuffix(":calibrated"), kv.endswith(":calibrated")
        scales = calibrated_kv_scales(path, args.calib_samples) if calibrated else None
        engine = Engine(model, EngineConfig(kv_dtype=variant, max_num_batched_tokens=args.ctx, max_model_len=args.ctx + 2,
                                            kv_cache_bytes=max(64, args.ctx // 16) << 20), layer_scales=scales)
        r = perplexity(lambda x, e=engine: e.score(x[0])[None], ids, args.text, context=args.ctx, stride=args.ctx // 2)
        results[kv] = r.perplexity
        print(f"KV {kv:20s}: {r.describe()}", flush=True)
    base = results.get("bf16")
    if base:
        for kv, p in results.items():
            print(f"KV {kv:20s}: {p:.4f}  ({100 * (p / base - 1):+.2f}% vs bf16 KV)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"text": args.text, "tokens": int(ids.numel()), "ctx": args.ctx,
                                         "calibration": f"{args.calib_samples} x 512 tokens of wikipedia:calib",
                                         "perplexity": results}, indent=2))
    return 0


def calibrated_kv_scales(path, num_samples: int) -> dict[int, tuple[float, float]]:
    """Per-layer ``(k_scale, v_scale)`` exactly as ``compress quantize --kv-cache-fp8`` writes them."""
    from compress.quantize_options import DEFAULT_CALIB_SEQ_LEN
    from compress.sequential_quantizer import windows_quantizer
    from foundation.calibration import CalibrationSpec, calibration_ids

    ids = calibration_ids(path, CalibrationSpec(num_samples=num_samples, seq_len=DEFAULT_CALIB_SEQ_LEN))
    tensors = windows_quantizer(path, "rtn", ids, kv_cache_fp8=True).finish()
    layers = sorted({int(n.split(".")[2]) for n in tensors})
    return {i: (float(tensors[f"model.layers.{i}.self_attn.k_scale"]), float(tensors[f"model.layers.{i}.self_attn.v_scale"]))
            for i in layers}


if __name__ == "__main__":
    raise SystemExit(main())
