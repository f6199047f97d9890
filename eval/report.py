"""Side-by-side report of checkpoints: bytes vs quality vs speed, measured on kvslim's runtime.

Per checkpoint: weight bytes (safetensors on disk, and resident once loaded), KV bytes per token
(the shared formula at ``context``), KV capacity (``runtime.cache.kv_report``: ``context``-token
sequences admitted into a ``budget`` cache until allocation fails), perplexity at the same
``context`` and task accuracy (``compress eval``'s pack through the ``kvslim`` backend, cached per
checkpoint), recovery vs the first checkpoint, and aggregate decode tokens/s of the engine with the
kernel path it ran; a checkpoint may be measured at several KV dtypes, one row each. One context for
bytes and quality: a sliding window or a sink saves nothing, and costs nothing, below it. Rendered
as one Markdown table, one PNG of the figures and one Pareto PNG (KV bytes per token against
perplexity, relative to the first row).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eval.perplexity_task import PERPLEXITY_TASKS
from eval.retrieval_task import DEFAULT_SAMPLES, RETRIEVAL_TASKS, depth_accuracies
from foundation.errors import KvslimError
from foundation.kv_plan_file import planned_kv_dtype
from foundation.quant_spec import QuantSpec

GIB = 1 << 30
MIB = 1 << 20
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ReportSettings:
    """What the numbers depend on (printed under the table)."""

    tasks: tuple[str, ...]
    limit: int | None  # docs per lm-eval task (None: the pack's fixed per-task limits)
    perplexity_tokens: int
    kv_budget_bytes: int = GIB
    context: int = 2048  # KV bytes and capacity at this many tokens; perplexity windows of this many, stride half
    decode_batch: int = 8
    decode_prompt_tokens: int = 64
    decode_new_tokens: int = 32
    dtype: str = "auto"  # activations for perplexity and tasks (auto: runtime.model.layers.activation_dtype)
    # Decode speed is measured with each of these activation dtypes and the fastest is reported;
    # auto is each checkpoint's fastest setting on this CPU by construction.
    decode_dtypes: tuple[str, ...] = ("auto",)
    retrieval_samples: int | None = None  # prompts per retrieval task and depth (None: the pack's 4)


@dataclass(frozen=True)
class CheckpointRow:
    name: str
    path: str
    weight_bytes: int
    kv_dtype: str
    kv_bytes_per_token: float
    kv_capacity_seqs: int
    perplexity: float | None
    perplexity_detail: str | None
    accuracy: dict[str, float]  # lm-eval task -> primary metric
    decode_tokens_per_s: float
    decode_dtype: str
    decode_path: str  # the Linears' kernel and the KV cache the decode ran on
    resident_weight_bytes: int  # weights as loaded for decoding (FP8 on a CPU: dequantized once)
    retrieval: dict[str, float] = field(default_factory=dict)  # retrieval task -> accuracy (eval.retrieval_task)
    retrieval_by_depth: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> "depth25" -> accuracy


def weight_bytes(ckpt: Path) -> int:
    """Bytes of the checkpoint's safetensors files (what is stored and loaded)."""
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def served_kv_dtype(config: dict, ckpt: Path | None = None) -> str:
    """The KV dtype a deployment would use: the checkpoint's FP8/INT8 KV scheme, else its KV plan's
    (``plan.json`` in ``ckpt``), else bf16."""
    quant = QuantSpec.of_model_config(config)
    planned = planned_kv_dtype(ckpt) if ckpt is not None else None
    return (quant.kv_dtype if quant else None) or planned or "bf16"


def fastest_decode(ckpt: Path, s: ReportSettings, kv_dtype: str | None = None) -> "DecodeRun":
    """The best of :func:`decode_tokens_per_s` over ``s.decode_dtypes``."""
    return max(decode_tokens_per_s(ckpt, s, dtype, kv_dtype) for dtype in s.decode_dtypes)


@dataclass(frozen=True, order=True)
class DecodeRun:
    tokens_per_s: float
    dtype: str
    path: str
    resident_weight_bytes: int


def decode_path(engine) -> str:
    """The kernel most of the engine's Linears run, and how its KV cache is stored."""
    from runtime.model.layers.linear import linear_kernels

    kernel = next(iter(linear_kernels(engine.model)), "dense GEMM")
    kv = []
    for g in engine.kv_spec.groups:
        name = f"packed {g.kv_dtype} KV" if g.bits else f"{g.kv_dtype} KV"
        if g.window is not None:
            name += f" (window {g.window})"
        kv.append(name)
    return f"{kernel}; {', '.join(dict.fromkeys(kv))}"


def decode_tokens_per_s(ckpt: Path, s: ReportSettings, dtype: str, kv_dtype: str | None = None) -> DecodeRun:
    """Aggregate decode tokens/s of the engine with ``dtype`` activations: ``decode_batch``
    concurrent requests with ``decode_prompt_tokens``-token prompts from ``wikipedia:eval``, timed
    over ``decode_new_tokens`` steps once every prompt has its first token: decode steps only, every
    request in each, at that context; with the path it ran and the weights' resident bytes."""
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import live_weight_bytes

    engine = Engine.from_checkpoint(ckpt, EngineConfig(dtype=dtype, max_num_seqs=s.decode_batch, kv_dtype=kv_dtype,
                                                       enable_prefix_caching=False))
    ids = _eval_token_ids(ckpt, s.decode_batch * s.decode_prompt_tokens)
    prompts = [ids[i * s.decode_prompt_tokens:(i + 1) * s.decode_prompt_tokens] for i in range(s.decode_batch)]
    _decode_steps(engine, prompts, 2)  # warm-up
    generated, seconds = _decode_steps(engine, prompts, s.decode_new_tokens)
    return DecodeRun(generated / max(seconds, 1e-9), engine.model.activation_dtype.name, decode_path(engine),
                     live_weight_bytes(engine.model))


def _decode_steps(engine, prompts: list[list[int]], steps: int) -> tuple[int, float]:
    """Tokens generated by ``steps`` decode steps taken once every prompt has its first token (each
    request decoding at each step), and the seconds they took; the requests are then aborted."""
    from runtime.engine.sampling import SamplingParams

    # Long enough that none finishes in the timed steps, however long prefill (chunked) ran before.
    params = SamplingParams(temperature=0, max_tokens=steps + sum(map(len, prompts)), ignore_eos=True)
    rids = {engine.add_request(p, params) for p in prompts}
    started: set[int] = set()
    while started != rids:
        started |= {o.request_id for o in engine.step() if o.token_ids}
    generated, start = 0, time.perf_counter()
    for _ in range(steps):
        generated += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    for rid in rids:
        engine.abort(rid)
    return generated, seconds


def _eval_token_ids(ckpt: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from foundation.perplexity import tokenize_range

    ids = tokenize_range(AutoTokenizer.from_pretrained(str(ckpt)), "wikipedia:eval", n).tolist()
    if len(ids) < n:
        raise KvslimError(f"wikipedia:eval has only {len(ids)} tokens, {n} needed")
    return ids


def measure(name: str, ckpt: Path, s: ReportSettings, use_cache: bool = True,
            kv_cache_dtype: str = "auto") -> CheckpointRow:
    """Every figure of one checkpoint (the eval part is cached by ``compress eval``), with the KV
    cache in ``kv_cache_dtype`` (a ``--kv-cache-dtype`` name; auto: the one it is served with)."""
    from eval.cached_evaluation import evaluate_cached
    from eval.lm_eval_runner import EvalPlan
    from runtime.cache.kv_dtype_choices import cache_kv_dtype
    from runtime.cache.kv_report import has_static_kv_scales, report_variant

    config = json.loads((ckpt / "config.json").read_text())
    chosen = cache_kv_dtype(kv_cache_dtype)
    served = served_kv_dtype(config, ckpt)
    kv_dtype = chosen or served
    static = has_static_kv_scales(ckpt) and kv_dtype == served
    kv = report_variant(name, config, kv_dtype, s.kv_budget_bytes, s.context, static_scales=static)
    scores = {}
    if s.tasks:  # none: bytes, capacity and decode alone
        plan = EvalPlan.make(list(s.tasks), s.limit, s.perplexity_tokens, 8, s.dtype,
                             kv_cache_dtype=kv_cache_dtype, context=s.context, retrieval_contexts=(s.context,),
                             retrieval_samples=s.retrieval_samples)
        scores = evaluate_cached(str(ckpt), plan, "kvslim", use_cache)[0].scores
    ppl_name = next((t for t in s.tasks if t in PERPLEXITY_TASKS), None)
    ppl = scores[ppl_name] if ppl_name else None
    accuracy = {t: sc.value for t, sc in scores.items() if t not in PERPLEXITY_TASKS and t not in RETRIEVAL_TASKS}
    retrieval = {t: sc.value for t, sc in scores.items() if t in RETRIEVAL_TASKS}
    by_depth = {t: {f"depth{d}": a for d, a in depth_accuracies(scores[t].metrics, s.context).items()}
                for t in retrieval}
    decode = fastest_decode(ckpt, s, chosen)
    return CheckpointRow(
        name=name, path=str(ckpt), weight_bytes=weight_bytes(ckpt), kv_dtype=kv_dtype,
        kv_bytes_per_token=kv.formula_bytes_per_token, kv_capacity_seqs=kv.capacity_seqs,
        perplexity=ppl.value if ppl else None, perplexity_detail=ppl.detail if ppl else None,
        accuracy=accuracy, decode_tokens_per_s=decode.tokens_per_s, decode_dtype=decode.dtype,
        decode_path=decode.path, resident_weight_bytes=decode.resident_weight_bytes, retrieval=retrieval,
        retrieval_by_depth=by_depth,
    )


def retrieval_cell(row: CheckpointRow, task: str) -> str:
    """"95% (100 100 100 75 100)": the task's accuracy, then by depth in points."""
    if task not in row.retrieval:
        return "-"
    depths = row.retrieval_by_depth.get(task, {})
    by_depth = f" ({' '.join(f'{100 * a:.0f}' for a in depths.values())})" if depths else ""
    return f"{row.retrieval[task]:.0%}{by_depth}"


def mean_accuracy(row: CheckpointRow) -> float | None:
    return sum(row.accuracy.values()) / len(row.accuracy) if row.accuracy else None


def recovery(row: CheckpointRow, base: CheckpointRow) -> float | None:
    """Mean over tasks of accuracy / the baseline's accuracy (tasks where the baseline scores > 0)."""
    ratios = [row.accuracy[t] / base.accuracy[t] for t in row.accuracy if base.accuracy.get(t)]
    return sum(ratios) / len(ratios) if ratios else None


def mean_retrieval(row: CheckpointRow) -> float | None:
    return sum(row.retrieval.values()) / len(row.retrieval) if row.retrieval else None


def kv_smaller(row: CheckpointRow, base: CheckpointRow) -> float:
    """How many times fewer KV bytes per token ``row`` holds than ``base``."""
    return base.kv_bytes_per_token / row.kv_bytes_per_token


def perplexity_change(row: CheckpointRow, base: CheckpointRow) -> float | None:
    """Relative perplexity change against ``base`` (0.05 = +5%), None where either is missing."""
    if row.perplexity is None or base.perplexity is None:
        return None
    return row.perplexity / base.perplexity - 1


def markdown_table(rows: list[CheckpointRow], s: ReportSettings) -> str:
    """The table (first row is the baseline of the recovery and ratio columns) and the settings under it."""
    tasks = list(rows[0].accuracy)
    head = (["checkpoint", "weights MiB (disk / resident)", "KV dtype", "KV B/token", "KV smaller",
             "KV capacity (seqs)", "perplexity", "ppl change"] + [f"{t} acc" for t in tasks]
            + ["mean acc", "recovery"] + [f"{t} (retrieval; by depth)" for t in rows[0].retrieval]
            + ["decode tok/s", "decode path"])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    base = rows[0]
    for r in rows:
        acc, rec, change = mean_accuracy(r), recovery(r, base), perplexity_change(r, base)
        cells = [r.name, f"{r.weight_bytes / MIB:,.1f} / {r.resident_weight_bytes / MIB:,.1f}", r.kv_dtype, f"{r.kv_bytes_per_token:,.0f}",
                 f"{kv_smaller(r, base):.2f}x", f"{r.kv_capacity_seqs:,}",
                 "-" if r.perplexity is None else f"{r.perplexity:,.2f}",
                 "-" if change is None else f"{change:+.2%}"]
        cells += [f"{r.accuracy[t]:.3f}" for t in tasks]
        cells += ["-" if acc is None else f"{acc:.3f}", "-" if rec is None else f"{rec:.1%}"]
        cells += [retrieval_cell(r, t) for t in rows[0].retrieval]
        cells += [f"{r.decode_tokens_per_s:,.1f} ({DTYPE_SHORT.get(r.decode_dtype, r.decode_dtype)})", r.decode_path]
        lines.append("| " + " | ".join(cells) + " |")
    limit = "the pack's fixed per-task limits" if s.limit is None else f"first {s.limit} docs per task"
    stride = max(1, s.context // 2)
    lines += [
        "",
        f"- Context: {s.context} tokens for bytes and quality alike. KV B/token: the shared formula at {s.context} "
        "tokens, in the row's KV dtype (by default the one served: the checkpoint's kv_cache_scheme, else its KV "
        f"plan's, else bf16); KV smaller and ppl change: against {base.name}. KV capacity: {s.context}-token "
        f"sequences admitted into a {s.kv_budget_bytes / GIB:g} GiB paged cache until allocation fails "
        "(runtime/cache/kv_report.py).",
        f"- Perplexity: {rows[0].perplexity_detail or 'not measured'}: windows of {s.context} tokens every "
        f"{stride}, so every token after the first window is scored with {s.context - stride} to {s.context - 1} "
        f"tokens before it, served by the kvslim runtime with the row's KV cache (foundation/perplexity.py; "
        f"{s.dtype} activations: each row's dtype is named in brackets after its decode tok/s). "
        + (f"Accuracy: lm-eval 0-shot, {limit}, on kvslim's engine (`--backend kvslim`); "
           f"recovery = mean over tasks of accuracy / {base.name}'s." if tasks else "No lm-eval task."),
        *([f"- Retrieval (eval/retrieval_task.py): a fact stated once in a {s.context}-token prompt, at depths 0, 25, "
           f"50, 75 and 100% of it ({s.retrieval_samples or DEFAULT_SAMPLES} prompts each), asked for at its end; greedy through the kvslim engine with the row's KV cache as "
           "served; accuracy = the first number answered is the key. Perplexity cannot see what a window or a "
           "coarse cache loses here."] if rows[0].retrieval else []),
        f"- Decode tok/s: kvslim engine, {s.decode_batch} concurrent requests, "
        f"{s.decode_prompt_tokens}-token prompts of wikipedia:eval; aggregate tokens/s of {s.decode_new_tokens} "
        "decode steps taken once every request has its first token; KV in the row's dtype (by default the "
        "checkpoint's kv_cache_scheme, else its KV plan's, else the activation dtype); activations "
        + ("auto (the runtime's choice on this CPU)" if s.decode_dtypes == ("auto",)
           else f"the fastest of {', '.join(s.decode_dtypes)} per checkpoint")
        + ", named in brackets. Decode path: the kernel most of the row's Linears ran and how its KV was stored. "
        "Weights resident: bytes held once loaded for decoding (FP8 on a CPU is dequantized once, to 2 bytes "
        "a weight in bf16).",
    ]
    return "\n".join(lines)


def plot(rows: list[CheckpointRow], path: Path, s: ReportSettings) -> None:
    """One PNG: six bar panels, one per figure, checkpoints on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    panels = [
        ("Weights (MiB, on disk)", [r.weight_bytes / MIB for r in rows], "{:,.0f}"),
        ("KV cache (bytes/token)", [r.kv_bytes_per_token for r in rows], "{:,.0f}"),
        (f"KV capacity ({s.context}-token seqs in {s.kv_budget_bytes / GIB:g} GiB)", [r.kv_capacity_seqs for r in rows], "{:,.0f}"),
        (f"Perplexity (wikipedia:eval, context {s.context}; lower is better)", [r.perplexity for r in rows], "{:,.2f}"),
        ("Mean task accuracy (0-shot)", [mean_accuracy(r) for r in rows], "{:.3f}"),
        (f"Decode (tokens/s, {s.decode_batch} concurrent)", [r.decode_tokens_per_s for r in rows], "{:,.1f}"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5 if len(rows) <= 5 else 9.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, values, fmt) in zip(axes.flat, panels):
        ax.set_title(title, fontsize=11)
        crowded = len(rows) > 5
        ax.set_xticks(range(len(rows)), names, rotation=40 if crowded else 20, ha="right", fontsize=8 if crowded else 9)
        if all(v is None for v in values):
            ax.set_yticks([])
            ax.set_xlim(-0.5, len(rows) - 0.5)
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        heights = [0.0 if v is None else v for v in values]
        bars = ax.bar(range(len(rows)), heights, color=[colors[i % len(colors)] for i in range(len(rows))])
        ax.bar_label(bars, labels=["-" if v is None else fmt.format(v) for v in values],
                     fontsize=6.5 if len(rows) > 6 else 8, padding=2)
        ax.set_ylim(0, max(heights) * 1.18 or 1.0)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"kvslim: bytes, quality and speed per checkpoint (kvslim runtime; bytes and perplexity at context "
                 f"{s.context})", fontsize=13)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_pareto(rows: list[CheckpointRow], path: Path, s: ReportSettings) -> None:
    """One PNG: KV bytes per token (times fewer than the first row, log scale) against the
    perplexity change (linear within +-10%, logarithmic beyond, so a collapsed rewrite does not
    flatten the rest) and, where measured, against the retrieval accuracy change in points: one
    labelled point per row; the rows no other row beats on both axes of a panel are joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]
    ppl = [(kv_smaller(r, base), 100 * perplexity_change(r, base), r.name) for r in rows
           if perplexity_change(r, base) is not None]
    ret = [(kv_smaller(r, base), 100 * (mean_retrieval(r) - mean_retrieval(base)), r.name) for r in rows
           if r.retrieval and base.retrieval]
    fig, axes = plt.subplots(1, 2 if ret else 1, figsize=(16 if ret else 9, 6), squeeze=False)
    _pareto_panel(axes[0][0], ppl, lower_is_better=True, what="perplexity")
    axes[0][0].set_ylabel(f"perplexity change vs {base.name} at context {s.context} (%)")
    axes[0][0].set_title("KV bytes vs perplexity (lower right is better)")
    if ret:
        _pareto_panel(axes[0][1], ret, lower_is_better=False, what="retrieval")
        axes[0][1].set_ylabel(f"retrieval accuracy change vs {base.name} ({', '.join(base.retrieval)}; points)")
        axes[0][1].set_title("KV bytes vs retrieval of a fact stated once (upper right is better)")
    for ax in axes[0]:
        ax.set_xlabel(f"KV bytes per token at {s.context} tokens: times fewer than {base.name}")
    fig.suptitle("kvslim: KV bytes vs quality, served by the kvslim runtime")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _pareto_panel(ax, points: list[tuple[float, float, str]], lower_is_better: bool, what: str) -> None:
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    for x, y, name in points:
        ax.scatter(x, y, s=30)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    sign = 1 if lower_is_better else -1
    front = sorted(p for p in points if not any(
        q[0] >= p[0] and sign * q[1] <= sign * p[1] and q[:2] != p[:2] for q in points))
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="gray", alpha=0.5, zorder=0)
    ax.axhline(0, color="gray", lw=0.8)
    ax.grid(alpha=0.3, which="both")
    if not points:
        ax.text(0.5, 0.5, f"{what} not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    if lower_is_better:  # perplexity: symlog, a collapsed row does not flatten the rest
        ax.set_yscale("symlog", linthresh=10)
        top, bottom = max(max(p[1] for p in points) * 1.3, 10), min(min(p[1] for p in points) * 1.3, -2)
        yticks = [t for t in (-10, -5, -2, 0, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
                  if bottom <= t <= top]
        ax.set_ylim(bottom, top)
        ax.set_yticks(yticks, [f"{t:+g}%" if t else "0" for t in yticks])
    else:  # retrieval points: -100 .. +100
        ax.set_ylim(min(min(p[1] for p in points) - 10, -20), max(max(p[1] for p in points) + 10, 10))
    lo, hi = min(p[0] for p in points) / 1.5, max(p[0] for p in points) * 1.5
    ticks = [t for t in (0.5, 1, 2, 4, 8, 16, 32, 64) if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())  # no "3x10^0" between the plain ticks


def write_report(rows: list[CheckpointRow], out: Path, s: ReportSettings) -> tuple[Path, Path]:
    """report.md, report.png, pareto.png and report.json into ``out`` (an existing directory)."""
    md, png = out / "report.md", out / "report.png"
    md.write_text(markdown_table(rows, s) + "\n")
    plot(rows, png, s)
    plot_pareto(rows, out / "pareto.png", s)
    (out / "report.json").write_text(json.dumps({"settings": asdict(s), "rows": [asdict(r) for r in rows]}, indent=2))
    return md, png
