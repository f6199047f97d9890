"""Healing curve: held-out perplexity against healing minutes for converted default models.

For each rewrite (calibrated convert, one shared calibration capture of 2 x 1024 tokens of
``wikipedia:calib``), heal with ``compress heal``'s defaults (attention of the rewritten layers,
KL on logits, ``wikipedia:heal``) for ``--minutes`` of training time, and evaluate the student
at each mark (evaluation time excluded) on the first ``--tokens`` of ``wikipedia:eval``
(context 512, stride 256) and on one lm-eval task of the pack (``--task``, first ``--task-limit``
docs). Minutes are CPU minutes by default (process CPU time / threads: the wall time on idle
cores, so a shared machine does not shrink the budget); the wall time is recorded beside them.
Writes a JSON table and a PNG.

    python benchmarks/heal_curve.py [--minutes 20] [--marks 5,10,20] [--device cpu]
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
    "MQA aligned": dict(kv_heads=1, merge="aligned"),
    "kv-share 2": dict(kv_share=2),
    "MQA + kv-share 2": dict(kv_heads=1, kv_share=2),
}
CONTEXT, STRIDE = 512, 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--marks", default="5,10,20", help="training minutes at which to evaluate")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--task", default="lambada_openai", help="lm-eval task of the pack scored at each mark")
    parser.add_argument("--task-limit", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1024, help="wikipedia:eval tokens per evaluation")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences of 256 tokens per step")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: heal's, per rewrite)")
    parser.add_argument("--hidden-weight", type=float, default=0.0, help="hidden-state matching weight (0: KL only)")
    parser.add_argument("--train", default="attn", choices=("attn", "all", "lora"))
    parser.add_argument("--local-steps", type=int, default=0, help="layer-local reconstruction steps first (heal's --local-steps)")
    parser.add_argument("--tag", default="", help="appended to each curve's label (e.g. the budget, to keep two apart)")
    parser.add_argument("--out", default="benchmarks/results/heal_curve.json")
    parser.add_argument("--merge", action="store_true", help="keep the other rewrites' curves already in --out")
    parser.add_argument("--keep", metavar="DIR", help="write the healed checkpoints to DIR/<rewrite> (default: discard)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    from attention_variants.attention_inputs import capture_attention_inputs
    from attention_variants.convert import ConvertSpec, convert
    from attention_variants.heal import HealSpec, heal
    from attention_variants.summary import load_for_eval
    from foundation.calibration import calibration_ids
    from foundation.model_source import resolve_model
    from foundation.perplexity import hf_logits_fn, perplexity, tokenize_range

    source = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    eval_ids = tokenize_range(tokenizer, "wikipedia:eval", max_tokens=args.tokens)

    from eval.lm_eval_runner import EvalPlan, hf_eval_model, lm_eval_scores

    plan = EvalPlan.make([args.task], args.task_limit, None, 8)

    def ppl(model) -> float:
        return perplexity(hf_logits_fn(model), eval_ids, "wikipedia:eval", CONTEXT, STRIDE).perplexity

    def task_score(model) -> float:
        return lm_eval_scores(hf_eval_model(model, tokenizer, 8), plan)[args.task].value

    def measure(model) -> dict:
        return dict(ppl=ppl(model), task=task_score(model))

    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    calibration = ConvertSpec().calibration
    calib = capture_attention_inputs(original, calibration_ids(source, calibration), calibration.source)
    teacher = measure(original)
    del original
    print(f"original: ppl {teacher['ppl']:.3f}, {args.task} {teacher['task']:.3f}", flush=True)
    marks = [float(m) for m in args.marks.split(",")]
    curves = json.loads(Path(args.out).read_text())["curves"] if args.merge and Path(args.out).is_file() else {}
    with tempfile.TemporaryDirectory(prefix="heal-curve-") as tmp:
        for rewrite in args.configs.split(","):
            label = rewrite + settings_suffix(args) + (f" {args.tag}" if args.tag else "")
            converted = Path(tmp) / f"conv{len(curves)}"
            convert(source, ConvertSpec(**CONFIGS[rewrite]), converted, calib=calib)
            points = [dict(minutes=0.0, wall_minutes=0.0, tokens=0, loss=None, **measure(load_for_eval(converted)))]
            print(f"{label}: 0.0 min ppl {points[0]['ppl']:.2f} {args.task} {points[0]['task']:.3f}", flush=True)
            pending = list(marks)

            def on_step(report, model):
                if pending and report.train_seconds >= 60 * pending[0]:
                    pending.pop(0)
                    p = dict(minutes=round(report.train_seconds / 60, 2), wall_minutes=round(report.wall_seconds / 60, 2),
                             tokens=report.tokens, loss=round(report.loss, 4), **measure(model))
                    points.append(p)
                    print(f"{label}: {p['minutes']} min ({p['wall_minutes']} wall), {p['tokens']} tokens, "
                          f"loss {p['loss']}, ppl {p['ppl']:.2f}, {args.task} {p['task']:.3f}", flush=True)

            t = time.time()
            spec = HealSpec(minutes=args.minutes, clock=args.clock, device=args.device, batch_size=args.batch_size,
                            lr=args.lr, hidden_weight=args.hidden_weight, train=args.train, local_steps=args.local_steps)
            result = heal(converted, source, spec, healed_dir(args.keep, tmp, label), on_step=on_step, force=True)
            if points[-1]["tokens"] < result.tokens:  # the budget ran out between marks
                points.append(dict(minutes=round(result.train_seconds / 60, 2), wall_minutes=round(result.wall_seconds / 60, 2),
                                   tokens=result.tokens, loss=round(result.last_loss, 4), **measure(load_for_eval(result.out))))
            curves[label] = dict(points=points, wall_s=round(time.time() - t, 1), minutes=args.minutes,
                                 lr=result.lr, hidden_weight=spec.hidden_weight, train=spec.train)
            write(args, dict(
                model=args.model, device=args.device, teacher_ppl=teacher["ppl"], teacher_task=teacher["task"],
                clock=args.clock, task=f"{args.task}, first {plan.limits[args.task]} docs, 0-shot",
                eval=f"wikipedia:eval, first {args.tokens} tokens, context {CONTEXT}, stride {STRIDE}",
                heal=f"wikipedia:heal, batch {args.batch_size} x 256 tokens, KL on logits (+ hidden-state matching "
                     f"where a curve's hidden_weight > 0), AdamW at each curve's lr and train set, "
                     f"{HealSpec.warmup_steps} warmup steps then cosine over each curve's {args.clock} minutes",
                calibration=calib.describe(), machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
                curves=curves))
    return 0


def settings_suffix(args) -> str:
    """`` [lr 0.0002, hidden 1, train all]`` for the settings that differ from the defaults."""
    parts = [f"lr {args.lr:g}"] if args.lr else []
    parts += [f"hidden {args.hidden_weight:g}"] if args.hidden_weight else []
    parts += [f"train {args.train}"] if args.train != "attn" else []
    parts += [f"local {args.local_steps}"] if args.local_steps else []
    return f" [{', '.join(parts)}]" if parts else ""


def healed_dir(keep: str | None, tmp: str, label: str) -> Path:
    slug = label.lower().replace(" + ", "-").replace(" ", "").replace("[", "-").replace("]", "").replace(",", "-")
    return Path(keep or tmp) / f"healed-{slug}"


def write(args, result: dict) -> None:
    """The JSON table and a two-panel PNG (perplexity, task score) against healing minutes."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ppl, ax_task) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, c in result["curves"].items():
        minutes = [p["minutes"] for p in c["points"]]
        ax_ppl.plot(minutes, [p["ppl"] for p in c["points"]], marker="o", label=label)
        ax_task.plot(minutes, [p["task"] for p in c["points"]], marker="o", label=label)
    for ax, ref, ylabel in ((ax_ppl, result["teacher_ppl"], f"perplexity ({result['eval']})"),
                            (ax_task, result["teacher_task"], f"accuracy ({result['task']})")):
        ax.axhline(ref, color="k", linestyle="--", label="original")
        if ax is ax_ppl:
            ax.axhline(1.10 * ref, color="g", linestyle=":", label="+10%")
        ax.set_xlabel(f"healing minutes ({args.device}, {args.clock} clock)")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_ppl.set_yscale("log")
    fig.suptitle(f"Healing {result['model']}: {result['heal']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
