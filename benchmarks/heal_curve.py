"""Healing curve: held-out perplexity against healing minutes for converted default models.

For each rewrite (calibrated convert, one shared calibration capture of 2 x 1024 tokens of
``wikipedia:calib``), heal with ``compress heal``'s defaults (attention of the rewritten layers,
KL on logits, ``wikipedia:heal``) for ``--minutes`` of training time, and evaluate the student
at each mark (evaluation time excluded) on the first ``--tokens`` of ``wikipedia:eval``
(context 512, stride 256). Writes a JSON table and a PNG.

    python benchmarks/heal_curve.py [--minutes 10] [--marks 2.5,5,10] [--device cpu]
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

CONFIGS = {
    "MQA": dict(kv_heads=1),
    "kv-share 2": dict(kv_share=2),
    "MQA + kv-share 2": dict(kv_heads=1, kv_share=2),
}
CONTEXT, STRIDE = 512, 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--marks", default="2.5,5,10", help="training minutes at which to evaluate")
    parser.add_argument("--tokens", type=int, default=1024, help="wikipedia:eval tokens per evaluation")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences of 256 tokens per step")
    parser.add_argument("--out", default="benchmarks/results/heal_curve.json")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    from attention_variants.calibration import calibration_batches, capture_attention_inputs
    from attention_variants.convert import ConvertSpec, convert
    from attention_variants.heal import HealSpec, heal
    from attention_variants.summary import load_for_eval
    from compress.model_source import resolve_model
    from eval.perplexity import hf_logits_fn, perplexity, tokenize_range

    source = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eval_ids = tokenize_range(tokenizer, "wikipedia:eval", max_tokens=args.tokens)

    def ppl(model) -> float:
        return perplexity(hf_logits_fn(model), eval_ids, "wikipedia:eval", CONTEXT, STRIDE).perplexity

    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    name, calib_ids = calibration_batches(tokenizer, None, 2, 1024)
    calib = capture_attention_inputs(original, calib_ids, name)
    teacher_ppl = ppl(original)
    del original
    print(f"original: ppl {teacher_ppl:.3f}", flush=True)
    marks = [float(m) for m in args.marks.split(",")]
    curves = {}
    with tempfile.TemporaryDirectory(prefix="heal-curve-") as tmp:
        for label in args.configs.split(","):
            converted = Path(tmp) / f"conv{len(curves)}"
            convert(source, ConvertSpec(**CONFIGS[label]), converted, calib=calib)
            points = [dict(minutes=0.0, tokens=0, loss=None, ppl=ppl(load_for_eval(converted)))]
            print(f"{label}: 0.0 min ppl {points[0]['ppl']:.2f}", flush=True)
            pending = list(marks)

            def on_step(report, model):
                if pending and report.train_seconds >= 60 * pending[0]:
                    pending.pop(0)
                    p = dict(minutes=round(report.train_seconds / 60, 2), tokens=report.tokens,
                             loss=round(report.loss, 4), ppl=ppl(model))
                    points.append(p)
                    print(f"{label}: {p['minutes']} min, {p['tokens']} tokens, loss {p['loss']}, ppl {p['ppl']:.2f}", flush=True)

            t = time.time()
            heal(converted, source, HealSpec(minutes=args.minutes, device=args.device, batch_size=args.batch_size),
                 Path(tmp) / f"healed{len(curves)}", on_step=on_step)
            curves[label] = dict(points=points, wall_s=round(time.time() - t, 1))
    result = dict(model=args.model, device=args.device, teacher_ppl=teacher_ppl,
                  eval=f"wikipedia:eval, first {args.tokens} tokens, context {CONTEXT}, stride {STRIDE}",
                  heal=f"wikipedia:heal, batch {args.batch_size} x 256 tokens, attention of rewritten layers, KL on logits, "
                       f"AdamW lr {HealSpec.lr}, {HealSpec.warmup_steps} warmup steps then cosine over {args.minutes} min "
                       "(compress heal's defaults but the batch size)",
                  calibration=calib.describe(), machine=f"{platform.machine()}, 2 threads, shared and noisy",
                  curves=curves)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, c in curves.items():
        ax.plot([p["minutes"] for p in c["points"]], [p["ppl"] for p in c["points"]], marker="o", label=label)
    ax.axhline(teacher_ppl, color="k", linestyle="--", label="original")
    ax.set_yscale("log")
    ax.set_xlabel(f"healing minutes ({args.device}, shared machine)")
    ax.set_ylabel("perplexity, wikipedia:eval")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
