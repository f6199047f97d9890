"""Streaming heads served: which head score (``--streaming-select mass|output``) keeps more quality,
measured through the runtime's paged cache (streaming heads really in their own window-bounded
pools) on the dev slice, never on evaluation text.

Heads are scored once on 2 x 1,024 tokens of ``wikipedia:calib`` (``compress convert``'s default
calibration); each row streams the lowest-scored fraction of all KV heads over sinks + window, or
every head of all layers but the named full ones (the per-layer choice, for comparison). Bytes per
token are counted by allocating the paged cache for one ``--ctx``-token sequence (``kv_report``).

    python benchmarks/streaming_heads_served.py --json benchmarks/results/streaming_heads_served.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def streaming_config(base: dict, heads: tuple[tuple[int, ...], ...], window: int, sinks: int) -> dict:
    return {**base, "streaming_heads": {"window": window, "sinks": sinks, "kv_heads": [list(h) for h in heads]}}


def counted_bytes(config: dict, kv_dtype: str, ctx: int) -> float:
    """KV bytes per token at ``ctx``, counted from a real allocation holding one sequence."""
    from runtime.cache.kv_report import report_variant

    return report_variant("row", config, kv_dtype, 256 << 20, seq_len=ctx).counted_bytes_per_token


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.75, 0.8333])
    ap.add_argument("--layers", nargs="*", default=["20,23,24,25,26"],
                    help="per-layer rows: the full layers, comma separated (every head of the others streams)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from dev_slice import dev_slice
    from transformers import AutoModelForCausalLM

    from attention_variants.streaming_heads import head_scores, streaming_kv_heads
    from eval.kv_plan_measurements import served_perplexity
    from foundation.calibration import CalibrationSpec, calibration_ids
    from foundation.checkpoint import Checkpoint
    from foundation.model_source import resolve_model

    path = resolve_model("smollm2")
    base = Checkpoint.open(path).config
    ids, name = dev_slice(path, 64, args.tokens)
    calib = calibration_ids(path, CalibrationSpec(source="wikipedia:calib", num_samples=2, seq_len=1024))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    scores = head_scores(model, calib, args.window, args.sinks)
    del model
    n_layers, kvh = scores["mass"].shape
    rows: dict[str, tuple[tuple[int, ...], ...]] = {"full attention": ((),) * n_layers}
    for f in args.fractions:
        for select, score in scores.items():
            rows[f"{f:g} of heads, by {select}"] = streaming_kv_heads(score, f)
    for layers in args.layers:
        full = {int(i) for i in layers.split(",")}
        rows[f"every head but layers {layers}"] = tuple(() if i in full else tuple(range(kvh)) for i in range(n_layers))
    original = counted_bytes(base, "bf16", args.ctx)
    results = {}
    for label, heads in rows.items():
        config = streaming_config(base, heads, args.window, args.sinks) if any(heads) else base
        ppl = served_perplexity(path, config, args.kv_dtype, ids, name, args.ctx)
        b = counted_bytes(config, args.kv_dtype, args.ctx)
        results[label] = {"ppl": ppl, "bytes_per_token": b, "times_smaller": original / b,
                          "streaming_heads": sum(map(len, heads)), "kv_heads": [list(h) for h in heads]}
        print(f"{label:34s} {sum(map(len, heads)):3d} streaming  {b:8.0f} B/tok  {original / b:5.2f}x  ppl {ppl:.3f}",
              flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        doc = {"text": name, "ctx": args.ctx, "window": args.window, "sinks": args.sinks, "kv_dtype": args.kv_dtype,
               "calibration": "2 x 1024 tokens of wikipedia:calib", "original_bytes_per_token": original,
               "scores": {k: v.tolist() for k, v in scores.items()}, "runs": results}
        write_text_atomic(args.json, json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
