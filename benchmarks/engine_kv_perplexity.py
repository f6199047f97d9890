"""Perplexity through the engine's paged cache at each KV dtype (the shared perplexity function).

Logits come from ``Engine.score``: each window runs through the paged cache, so quantized K/V is
written and read back exactly as when serving. Weights fp32 (the default model's dequantized GGUF).

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
    ap.add_argument("--text", default="wikipedia:eval")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8_e4m3", "int8"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    from compress.model_source import resolve_model
    from eval.perplexity import perplexity, tokenize_range
    from runtime.engine import Engine, EngineConfig
    from runtime.loader import load_model

    path = resolve_model(args.model)
    ids = tokenize_range(AutoTokenizer.from_pretrained(path), args.text, max_tokens=args.tokens)
    model = load_model(path, "float32")
    results = {}
    for kv in args.kv_dtypes:
        engine = Engine(model, EngineConfig(kv_dtype=kv, max_num_batched_tokens=512, max_model_len=512,
                                            kv_cache_bytes=64 << 20))
        r = perplexity(lambda x: engine.score(x[0])[None], ids, args.text)
        results[kv] = r.perplexity
        print(f"KV {kv:9s}: {r.describe()}", flush=True)
    base = results.get("bf16")
    if base:
        for kv, p in results.items():
            print(f"KV {kv:9s}: {p:.4f}  ({100 * (p / base - 1):+.2f}% vs bf16 KV)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"text": args.text, "tokens": int(ids.numel()), "perplexity": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
