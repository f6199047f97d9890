"""`compress convert` on the default model: KV bytes per token and unhealed held-out perplexity
for each rewrite alone and combined (no healing; that is the heal benchmark's job).

Calibration (one capture, shared by all rewrites): 2 x 1024 tokens of ``wikipedia:calib``.
Perplexity: the shared function on the first ``--tokens`` tokens of ``wikipedia:eval`` at
context 1024, stride 512 (context beyond the sliding window, as the sliding rows need).
KV bytes per token: the shared formula (``AttentionLayout.kv_bytes_per_token``), bf16.

    python benchmarks/convert_quality.py [--model smollm2] [--tokens 2048] [--out benchmarks/results/convert_quality.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

WINDOW = 256
ROWS = {  # name -> ConvertSpec kwargs (None: the original model)
    "original": None,
    "MQA, mean-pool": dict(kv_heads=1, merge="mean"),
    "MQA, aligned then mean-pool": dict(kv_heads=1, merge="aligned"),
    "MQA, calibrated (default)": dict(kv_heads=1, merge="calib"),
    "kv-share 2, plain readers": dict(kv_share=2, merge="mean"),
    "kv-share 2, fitted readers (default)": dict(kv_share=2, merge="calib"),
    "kv-share 2, fitted, calibrated groups": dict(kv_share=2, merge="calib", kv_share_select="calib"),
    f"sliding {WINDOW}, 1 global in 6": dict(sliding_window=WINDOW, global_every=6),
    f"sliding {WINDOW}, 5 globals by calibration": dict(sliding_window=WINDOW, global_every=6, global_select="calib"),
    f"MQA + kv-share 2 + sliding {WINDOW} (1 in 6), calibrated": dict(
        kv_heads=1, kv_share=2, sliding_window=WINDOW, global_every=6, merge="calib"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=2048, help="wikipedia:eval tokens scored per row")
    parser.add_argument("--out", default="benchmarks/results/convert_quality.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    from attention_variants.attention_inputs import capture_attention_inputs
    from attention_variants.convert import ConvertSpec, convert
    from attention_variants.summary import BF16, EVAL_CONTEXT, EVAL_STRIDE, eval_perplexity
    from foundation.attention_layout import AttentionLayout
    from foundation.calibration import calibration_ids
    from foundation.checkpoint import Checkpoint
    from foundation.model_source import resolve_model

    source = resolve_model(args.model)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    calibration = ConvertSpec().calibration
    calib = capture_attention_inputs(model, calibration_ids(source, calibration), calibration.source, window=WINDOW)
    del model
    calib_s = time.time() - t0
    print(f"calibration: {calib.describe()} in {calib_s:.0f} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="convert-quality-") as tmp:
        for label, kwargs in ROWS.items():
            t = time.time()
            path = source if kwargs is None else Path(tmp) / f"row{len(rows)}"
            if kwargs is not None:
                convert(source, ConvertSpec(**kwargs), path, calib=calib)
            convert_s = time.time() - t
            layout = AttentionLayout.from_config(Checkpoint.open(path).config)
            ppl = eval_perplexity(path, args.tokens)
            row = dict(
                rewrite=label,
                kv_bytes_per_token_ctx1024=layout.kv_bytes_per_token(1024, BF16),
                kv_bytes_per_token_ctx8192=layout.kv_bytes_per_token(8192, BF16),
                perplexity=ppl.perplexity, convert_s=round(convert_s, 1), eval_s=round(time.time() - t - convert_s, 1),
            )
            rows.append(row)
            print(f"{label:58s} KV {row['kv_bytes_per_token_ctx1024'] / 1024:6.2f} / "
                  f"{row['kv_bytes_per_token_ctx8192'] / 1024:6.2f} KiB/token (ctx 1024 / 8192)  "
                  f"ppl {ppl.perplexity:12.2f}  ({row['convert_s']} s + {row['eval_s']} s)", flush=True)
    result = dict(
        model=args.model, eval=f"wikipedia:eval, first {args.tokens} tokens, context {EVAL_CONTEXT}, stride {EVAL_STRIDE}",
        calibration=calib.describe(), calibration_s=round(calib_s, 1), window=WINDOW,
        global_layers_by_calibration=[i for i, m in sorted(enumerate(calib.far_mass), key=lambda t: -t[1])[:5]],
        far_mass_beyond_window=[round(m, 4) for m in calib.far_mass],
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads, shared and noisy", rows=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
