"""`compress convert MODEL --kv-budget R` (or `--max-ppl-increase P`): the KV layout and dtype
chosen by measurement, written with the checkpoint as ``plan.json``.

The choices, at context N (default 2,048): the KV dtype (bf16, int8, int4, int2: one per cache,
as the runtime holds it), whether attention slides (a window W of 1,024, 512 or 256 below N, with
4 attention sinks), and which layers, or which KV heads (streaming heads), stay full. Layers are
ranked by the global-layer calibration ``compress convert --global-select calib`` uses (each
layer's attention mass beyond W on calibration windows of N tokens, sink keys counted as lost) and
KV heads by the same mass per head (``attention_variants.streaming_heads``, the score
``--streaming-heads`` ranks by), both measured for every W in one pass. For each dtype
and window, the budget allows a number of full layers, and a number of full KV heads (bytes per
token counted by allocating the paged cache for one N-token sequence, as ``kv_report`` does);
every such candidate is then *served* (the runtime's paged cache, really quantized and read back)
on a dev slice of the calibration text that no calibration window covers. With a budget the
lowest dev perplexity under it wins; with ``--max-ppl-increase`` the fewest bytes within P of the
original's dev perplexity (candidates served in order of bytes until one passes).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from attention_variants.convert import DEFAULT_SINKS, ConvertSpec, convert
from foundation.attention_layout import FULL, SINKS_KEY, SLIDING, STREAMING_KEY, AttentionLayout
from foundation.calibration import CalibrationSpec, load_tokenizer, token_windows
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.kv_plan_file import PLAN_FILE
from foundation.texts import DEFAULT_CALIB

DEFAULT_PLAN_CTX = 2048
PLAN_DTYPES = ("bf16", "int8", "int4", "int2")
PLAN_WINDOWS = (1024, 512, 256)
PLAN_SINKS = DEFAULT_SINKS  # convert's default with a window (StreamingLLM's 4)
CALIB_SEQS = 2  # calibration windows of N tokens for the layer ranking
DEV_WINDOWS = 2  # dev slice: 2 x N tokens after the calibration windows (3 scored windows at stride N/2)


@dataclass(frozen=True)
class KvChoice:
    """One point of the plan's space."""

    kv_dtype: str
    window: int | None = None  # None: every layer full
    global_layers: tuple[int, ...] = ()  # with a window: the layers kept full
    sinks: int = 0
    streaming: tuple[tuple[int, ...], ...] | None = None  # per layer, the KV heads streaming (else by layer)

    def describe(self, num_layers: int) -> str:
        if self.window is None:
            return f"{self.kv_dtype} KV, full attention"
        if self.streaming is not None:
            n = sum(map(len, self.streaming))
            return f"{self.kv_dtype} KV, {n} KV heads streaming over {self.sinks} sinks + window {self.window}"
        return (f"{self.kv_dtype} KV, sliding {self.window} + {self.sinks} sinks, "
                f"{len(self.global_layers)} of {num_layers} layers full")

    def config(self, base: dict) -> dict:
        """``base`` with this choice's layout (no change without a window)."""
        if self.window is None:
            return dict(base)
        if self.streaming is not None:
            heads = [list(h) for h in self.streaming]
            return {**base, STREAMING_KEY: {"window": self.window, "sinks": self.sinks, "kv_heads": heads}}
        n = int(base["num_hidden_layers"])
        types = [FULL if i in self.global_layers else SLIDING for i in range(n)]
        return {**base, "sliding_window": self.window, "layer_types": types, SINKS_KEY: self.sinks}


@dataclass(frozen=True)
class Candidate:
    choice: KvChoice
    kv_bytes_per_token: float  # at the plan's context, by allocation
    times_smaller: float  # the original's bf16 bytes per token / these
    dev_ppl: float | None = None  # served, on the dev slice (None: not served)


@dataclass(frozen=True)
class KvPlan:
    ctx: int
    budget: float | None
    max_ppl_increase: float | None
    num_layers: int
    original_kv_bytes_per_token: float  # bf16, the checkpoint's own layout
    original_dev_ppl: float
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    calibration: str
    dev_text: str

    @property
    def kv_cache_dtype(self) -> str:
        return self.chosen.choice.kv_dtype

    def to_json(self) -> str:
        """plan.json: the chosen KV dtype (what the runtime reads), the layout, the predicted bytes,
        and every candidate with its measurement."""
        c = self.chosen
        doc = {
            "kv_cache_dtype": self.kv_cache_dtype,
            "ctx": self.ctx,
            "kv_budget": self.budget,
            "max_ppl_increase": self.max_ppl_increase,
            "choice": c.choice.describe(self.num_layers),
            "sliding_window": c.choice.window,
            "sinks": c.choice.sinks,
            "global_layers": list(c.choice.global_layers) if c.choice.window and c.choice.streaming is None else None,
            "streaming_kv_heads": [list(h) for h in c.choice.streaming] if c.choice.streaming else None,
            "kv_bytes_per_token": round(c.kv_bytes_per_token, 1),
            "original_kv_bytes_per_token": round(self.original_kv_bytes_per_token, 1),
            "times_smaller": round(c.times_smaller, 3),
            "dev_ppl": c.dev_ppl,
            "original_dev_ppl": self.original_dev_ppl,
            "calibration": self.calibration,
            "dev_text": self.dev_text,
            "candidates": [{**asdict(x.choice), "kv_bytes_per_token": round(x.kv_bytes_per_token, 1),
                            "times_smaller": round(x.times_smaller, 3), "dev_ppl": x.dev_ppl}
                           for x in self.candidates],
        }
        return json.dumps(doc, indent=2) + "\n"


def check_request(config: dict, budget: float | None, max_ppl_increase: float | None, ctx: int) -> AttentionLayout:
    """Refuse what the planner cannot plan, in one line; the checkpoint's layout otherwise."""
    if (budget is None) == (max_ppl_increase is None):
        raise KvslimError("plan with exactly one of --kv-budget R or --max-ppl-increase P")
    if budget is not None and not 0 < budget <= 1:
        raise KvslimError(f"--kv-budget {budget} must be a fraction of the original's KV bytes in (0, 1]")
    if max_ppl_increase is not None and not max_ppl_increase >= 0:
        raise KvslimError(f"--max-ppl-increase {max_ppl_increase} must be 0 or more (0.1 = +10%)")
    if config.get("quantization_config"):
        raise KvslimError("checkpoint is quantized; plan the KV layout on unquantized weights, then quantize")
    positions = int(config.get("max_position_embeddings") or 0)
    if ctx < 2 or (positions and ctx > positions):
        raise KvslimError(f"--ctx {ctx} must be between 2 and the model's context ({positions})")
    layout = AttentionLayout.from_config(config)
    if layout.sliding_layers() or layout.streaming_layers() or len(layout.cache_owners()) != layout.num_layers:
        raise KvslimError("--kv-budget plans from a full-attention checkpoint without KV sharing "
                          "(this one has sliding, streaming-head or KV-sharing layers)")
    return layout


def layer_bytes(config: dict, kv_dtype: str, window: int | None, ctx: int) -> tuple[float, float]:
    """KV bytes per token at ``ctx`` of one full layer and one sliding layer (window + sinks),
    counted from a real allocation holding one ``ctx``-token sequence (``kv_report``)."""
    from runtime.cache.kv_report import report_variant

    n = int(config["num_hidden_layers"])
    probe = KvChoice(kv_dtype, window, (0,), PLAN_SINKS if window else 0)
    cfg = probe.config(config)
    if window is not None and n == 1:
        cfg = {**cfg, "layer_types": [SLIDING]}
    layout = AttentionLayout.from_config(cfg)
    budget = 2 * ctx * layout.kv_bytes_per_token(ctx, 4.0) + (64 << 20)  # room for one sequence, any dtype
    report = report_variant("plan", cfg, kv_dtype, int(budget), seq_len=ctx)
    per_layer = {g.kind: g.counted_bytes_per_token / g.num_layers for g in report.groups}
    full = per_layer.get("full", math.inf)
    return full, per_layer.get("sliding", full)


def original_bytes(config: dict, ctx: int) -> float:
    """KV bytes per token at ``ctx`` of the checkpoint's own layout in bf16: what a budget is a fraction of."""
    return layer_bytes(config, "bf16", None, ctx)[0] * int(config["num_hidden_layers"])


def allocated_bytes(config: dict, kv_dtype: str, ctx: int) -> float:
    """KV bytes per token at ``ctx`` of ``config``'s layout, counted from a real allocation holding
    one ``ctx``-token sequence."""
    from runtime.cache.kv_report import report_variant

    layout = AttentionLayout.from_config(config)
    budget = 2 * ctx * layout.kv_bytes_per_token(ctx, 4.0) + (64 << 20)
    return report_variant("plan", config, kv_dtype, int(budget), seq_len=ctx).counted_bytes_per_token


def head_candidates(config: dict, ctx: int, budget_bytes: float | None, head_ranking: dict[int, list[tuple[int, int]]],
                    original: float, dtype: str, layer_counts: dict[int, list[int]]) -> list[Candidate]:
    """Streaming-head choices for one dtype: per window, the most full KV heads the budget allows
    (without a budget: the full-layer ladder's counts in heads), the others streaming;
    ``head_ranking[W]``: (layer, head) by attention mass beyond W, most first. Bytes by allocation."""
    n, kvh = int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    out = []
    for w, ranked in head_ranking.items():
        f, s = layer_bytes(config, dtype, w, ctx)
        if budget_bytes is None:
            counts = [g * kvh for g in layer_counts[w]]
        else:
            most = math.floor((budget_bytes - n * s) * kvh / (f - s)) if f > s else n * kvh - 1
            counts = [min(most, n * kvh - 1)] if most >= 0 else []
        for k in counts:
            while k >= 0:
                full = set(ranked[:k])
                streaming = tuple(tuple(h for h in range(kvh) if (layer, h) not in full) for layer in range(n))
                choice = KvChoice(dtype, w, (), PLAN_SINKS, streaming)
                nbytes = allocated_bytes(choice.config(config), dtype, ctx)
                if budget_bytes is None or nbytes <= budget_bytes:
                    out.append(Candidate(choice, nbytes, original / nbytes))
                    break
                k -= 1  # block rounding: one head fewer
    return out


def candidates(config: dict, ctx: int, budget_bytes: float | None, ranking: dict[int, list[int]],
               original: float, dtypes: tuple[str, ...] = PLAN_DTYPES,
               head_ranking: dict[int, list[tuple[int, int]]] | None = None) -> list[Candidate]:
    """Every choice to serve, with its bytes: per dtype, full attention, and per window the most
    full layers the budget allows (without a budget: a ladder of full-layer counts), and with
    ``head_ranking`` the most full KV heads (``head_candidates``). ``ranking[W]``: the layers by
    attention mass beyond W, most first; ``original``: ``original_bytes``."""
    n = int(config["num_hidden_layers"])
    out = []
    for dtype in dtypes:
        cost = {w: layer_bytes(config, dtype, w, ctx) for w in (None, *ranking)}  # (full, sliding) per layer
        options = [KvChoice(dtype)]
        layer_counts = {}
        for w, ranked in ranking.items():
            f, s = cost[w]
            if budget_bytes is None:
                counts = sorted({n // 2, n // 3, n // 6, max(1, n // 10), 0} - {n})
            else:
                most = math.floor((budget_bytes - n * s) / (f - s)) if f > s else n - 1
                counts = [min(most, n - 1)] if most >= 0 else []
            layer_counts[w] = counts
            options += [KvChoice(dtype, w, tuple(sorted(ranked[:g])), PLAN_SINKS) for g in counts]
        for choice in options:
            g = len(choice.global_layers) if choice.window else n
            f, s = cost[choice.window]
            nbytes = g * f + (n - g) * s
            if budget_bytes is None or nbytes <= budget_bytes:
                out.append(Candidate(choice, nbytes, original / nbytes))
        if head_ranking:
            out += head_candidates(config, ctx, budget_bytes, head_ranking, original, dtype, layer_counts)
    return sorted(out, key=lambda c: c.kv_bytes_per_token)  # fewest bytes first


def rank(model_dir: Path, ids: torch.Tensor, windows: tuple[int, ...]) -> tuple[dict[int, list[int]],
                                                                             dict[int, list[tuple[int, int]]]]:
    """Per window, the layers and the (layer, KV head) pairs by attention mass beyond it on ``ids``
    (most first), from one pass (``head_scores_by_window``; a layer's mass is its heads' mean, the
    rule ``--global-select calib`` ranks layers by)."""
    from transformers import AutoModelForCausalLM

    from attention_variants.streaming_heads import head_scores_by_window

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, heads = {}, {}
    for w, scores in head_scores_by_window(model, ids, windows, PLAN_SINKS).items():
        mass = scores["mass"]
        layers[w] = mass.mean(1).argsort(descending=True, stable=True).tolist()
        heads[w] = [divmod(int(i), mass.shape[1]) for i in mass.flatten().argsort(descending=True, stable=True)]
    return layers, heads


def served_perplexity(model_dir: Path, config: dict, kv_dtype: str, ids: torch.Tensor, text: str, ctx: int) -> float:
    """Perplexity of ``ids`` at context ``ctx`` (stride ctx/2) through the runtime's paged cache,
    the checkpoint's weights under ``config``."""
    from foundation.perplexity import perplexity
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import load_model

    with tempfile.TemporaryDirectory(prefix="kvslim-plan-") as tmp:
        for f in Path(model_dir).iterdir():  # the weights as they are, the layout from config
            if f.name != "config.json":
                os.symlink(f.resolve(), Path(tmp) / f.name)
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = load_model(Path(tmp), "auto")
        room = min(ctx + 2, model.spec.max_position_embeddings)
        engine = Engine(model, EngineConfig(kv_dtype=kv_dtype, max_num_batched_tokens=ctx, max_model_len=room,
                                            kv_cache_bytes=max(64, ctx // 16) << 20))
        return perplexity(lambda x: engine.score(x[0])[None], ids, text, context=ctx, stride=max(1, ctx // 2)).perplexity


def plan_kv(model_dir: str | Path, budget: float | None = None, max_ppl_increase: float | None = None,
            ctx: int = DEFAULT_PLAN_CTX, calib: str | None = None, windows: tuple[int, ...] = PLAN_WINDOWS,
            dtypes: tuple[str, ...] = PLAN_DTYPES, progress: Callable[[str], None] = lambda _: None,
            heads: bool = True) -> KvPlan:
    """Choose the KV layout and dtype for ``model_dir`` (see the module docstring); ``heads``:
    streaming-head candidates too."""
    ckpt = Checkpoint.open(model_dir)
    config = ckpt.config
    layout = check_request(config, budget, max_ppl_increase, ctx)
    n = layout.num_layers
    windows = tuple(w for w in windows if w < ctx)
    source = calib or DEFAULT_CALIB
    spec = CalibrationSpec(source=source, num_samples=CALIB_SEQS + DEV_WINDOWS, seq_len=ctx)
    tokens = token_windows(load_tokenizer(ckpt.path)(spec.load_text(), add_special_tokens=False)["input_ids"], spec)
    calib_ids, dev = tokens[:CALIB_SEQS], tokens[CALIB_SEQS:].flatten()
    calibration = f"{CALIB_SEQS} x {ctx} tokens of {source}"
    dev_text = f"{source} tokens [{CALIB_SEQS * ctx}, {(CALIB_SEQS + DEV_WINDOWS) * ctx})"
    progress(f"ranking layers and KV heads by attention mass beyond windows {list(windows)} on {calibration}")
    ranking, head_ranking = rank(ckpt.path, calib_ids, windows) if windows else ({}, {})
    original = original_bytes(config, ctx)
    original_ppl = served_perplexity(ckpt.path, config, "bf16", dev, dev_text, ctx)
    progress(f"original (bf16 KV): {original:,.0f} B/token @{ctx}, dev ppl {original_ppl:.3f}")
    todo = candidates(config, ctx, None if budget is None else budget * original, ranking, original, dtypes,
                      head_ranking if heads else None)
    if not todo:
        raise KvslimError(f"no KV plan fits {budget:g} of the original's bytes at context {ctx} (the smallest: "
                          f"{min(dtypes, key=_bits)} with every layer sliding over the shortest window)")
    served = []
    for cand in todo:
        ppl = served_perplexity(ckpt.path, cand.choice.config(config), cand.choice.kv_dtype, dev, dev_text, ctx)
        cand = replace(cand, dev_ppl=ppl)
        served.append(cand)
        progress(f"{cand.choice.describe(n)}: {cand.kv_bytes_per_token:,.0f} B/token ({cand.times_smaller:.2f}x smaller), "
                 f"dev ppl {ppl:.3f} ({100 * (ppl / original_ppl - 1):+.2f}%)")
        if max_ppl_increase is not None and ppl <= original_ppl * (1 + max_ppl_increase):
            break
    if budget is not None:
        chosen = min(served, key=lambda c: c.dev_ppl)
    else:
        passing = [c for c in served if c.dev_ppl <= original_ppl * (1 + max_ppl_increase)]
        chosen = passing[0] if passing else None
        if chosen is None:
            raise KvslimError(f"no KV plan stays within +{100 * max_ppl_increase:g}% dev perplexity "
                              f"(the best: {min(served, key=lambda c: c.dev_ppl).dev_ppl:.3f} vs {original_ppl:.3f})")
    return KvPlan(ctx, budget, max_ppl_increase, n, original, original_ppl, chosen, tuple(served),
                  calibration, dev_text)


def _bits(dtype: str) -> int:
    return {"int2": 2, "int4": 4, "int8": 8}.get(dtype, 16)


def write_planned_checkpoint(model_dir: str | Path, plan: KvPlan, out: str | Path, force: bool = False) -> Path:
    """The checkpoint with the plan's layout (``compress convert``'s sliding rewrite and sinks) and
    ``plan.json``, written atomically."""
    from foundation.atomic import atomic_output_dir, check_output_dir

    choice = plan.chosen.choice
    if choice.window is not None:
        spec = ConvertSpec(sliding_window=choice.window, global_layers=choice.global_layers, sinks=choice.sinks)
        if choice.streaming is not None:
            spec = ConvertSpec(sliding_window=choice.window, sinks=choice.sinks, streaming_set=choice.streaming)
        return convert(Path(model_dir), spec, Path(out), force=force, extra_files={PLAN_FILE: plan.to_json()}).out
    ckpt = Checkpoint.open(model_dir)
    check_output_dir(Path(out), force)
    with atomic_output_dir(out, force, checked=True) as tmp:  # the weights unchanged, the plan beside them
        for f in ckpt.path.iterdir():
            if f.is_file() and f.name != PLAN_FILE:
                shutil.copy2(f, tmp / f.name)
        (tmp / PLAN_FILE).write_text(plan.to_json())
    return Path(out)
