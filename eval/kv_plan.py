"""`compress convert MODEL --kv-budget R` (or `--max-ppl-increase P`): the KV layout and dtype
chosen by measurement, written with the checkpoint as ``plan.json``.

The choices, at context N (default 2,048): the KV dtype (bf16, int8, int4, int2, or when asked
k4v2, k3v2 or a mix such as int4/int2: full-attention KV in one, sliding layers' and streaming
heads' in the other), whether attention slides (a window W of 1,024, 512 or 256 below N, with 4 attention
sinks), and which layers, or which KV heads (streaming heads), stay full. Layers are
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

Perplexity barely sees what a window or a coarse cache loses on a fact stated once, so a plan is
also bounded by retrieval (``eval.retrieval_bound``: within 5 points of the original's accuracy at
every depth, and every fact the original finds at most half as likely per answer token) on
calibration retrieval prompts (``eval.retrieval_task``'s ``*_calib`` wording and
``wikipedia:calib`` prose, disjoint from the evaluation tasks), served like the perplexity. Streaming
heads are then chosen DuoAttention's way, by what streaming each head alone costs the answers of
other calibration retrieval prompts (the gradient of their log-probability at a gate mixing the
head's full and streaming attention, ``attention_variants.retrieval_gates``), instead of by attention
mass beyond the window on ordinary text (which keeps perplexity as well and lost the early facts in
every plan measured) or by the attention the question puts on the fact (which lost some). With a
``HIGH/LOW`` mix among the dtypes, the heads the question's attention finds the fact through may
also keep ``HIGH`` while the others store ``LOW`` over the whole context (KV bits per head,
``eval.kv_precision_heads``).
The candidates best by dev perplexity are checked in that
order (at most ``RETRIEVAL_CHECKS``) and the first within the bound is chosen. Where none is (with a
budget), the heads are ranked again with the gates re-measured as the lowest-scored stream, down to
as many full heads (``attention_variants.retrieval_gates.pruned_gate_order``: one gate pass per
step, so only when needed), and those candidates are served and checked too; where none is still,
the best dev perplexity among those whose worst depth keeps the most, and ``plan.json`` says the bound
was missed. (Hits at the other depths, one prompt moving a depth 50 points, do not outweigh dev
perplexity measured on thousands of tokens: the plan forgets at its worst depth either way.)
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from attention_variants.convert import DEFAULT_SINKS, ConvertSpec, convert
from eval.kv_plan_measurements import gate_rank, rank, retrieval_rank, served_perplexity, served_retrieval
from eval.retrieval_bound import DEFAULT_MAX_LOGPROB_DROP, DEFAULT_MIN_RETRIEVAL, RetrievalBound, ServedRetrieval
from eval.retrieval_task import by_depth_line
from foundation.attention_layout import FULL, SINKS_KEY, SLIDING, STREAMING_KEY, AttentionLayout
from foundation.calibration import CalibrationSpec, load_tokenizer, token_windows
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.kv_dtype_mix import SEPARATOR, split_variants
from foundation.kv_plan_file import PLAN_FILE, PLANNER_KV_DTYPES
from foundation.texts import DEFAULT_CALIB

if TYPE_CHECKING:
    from torch import Tensor

DEFAULT_PLAN_CTX = 2048
PLAN_DTYPES = PLANNER_KV_DTYPES  # and mixes such as int4/int2 (foundation.kv_dtype_mix) when asked
PLAN_WINDOWS = (1024, 512, 256)
PLAN_SINKS = DEFAULT_SINKS  # convert's default with a window (StreamingLLM's 4)
CALIB_SEQS = 2  # calibration windows of N tokens for the layer ranking
DEV_WINDOWS = 2  # dev slice: 2 x N tokens after the calibration windows (3 scored windows at stride N/2)
RETRIEVAL_CALIB = ("passkey_calib", "needle_calib")  # eval.retrieval_task: never the evaluation wording
RETRIEVAL_DEPTHS = (0, 25, 50, 75, 100)
RETRIEVAL_SAMPLES = 1  # default prompts per task and depth: 2 per depth over both tasks (the demo's budget)
RANKING_DEPTHS = (0, 25, 50, 75)  # the KV heads' ranking prompts: 8 over both tasks, none the bound checks
GATE_RANKED = "retrieval gate"
PRUNED_GATE_RANKED = "retrieval gate, re-measured as heads stream"
RETRIEVAL_CHECKS = 6  # candidates whose retrieval is served, best dev perplexity first


@dataclass(frozen=True)
class KvChoice:
    """One point of the plan's space."""

    kv_dtype: str
    window: int | None = None  # None: every layer full
    global_layers: tuple[int, ...] = ()  # with a window: the layers kept full
    sinks: int = 0
    streaming: tuple[tuple[int, ...], ...] | None = None  # per layer, the KV heads streaming (else by layer)
    heads_by: str | None = None  # streaming heads: ranked by "mass" (beyond the window) or "retrieval"
    whole_context: bool = False  # streaming heads whose window is every position: KV bits per head

    def describe(self, num_layers: int) -> str:
        if self.window is None:
            return f"{self.kv_dtype} KV, full attention"
        if self.whole_context:
            high, low = split_variants(self.kv_dtype)[0].split(SEPARATOR)
            n = sum(map(len, self.streaming))
            return (f"{self.kv_dtype} KV by head: {n} KV heads in {low}, the rest in {high} (by {self.heads_by}), "
                    "whole context")
        if self.streaming is not None:
            n = sum(map(len, self.streaming))
            by = f" (full heads by {self.heads_by})" if self.heads_by else ""
            return f"{self.kv_dtype} KV, {n} KV heads streaming over {self.sinks} sinks + window {self.window}{by}"
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
    retrieval: ServedRetrieval | None = None  # calibration retrieval (None: not served)


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
    original_retrieval: ServedRetrieval | None = None
    bound: RetrievalBound | None = None  # None: not applied
    retrieval_prompts: str = ""
    heads_ranked_on: str = ""  # the prompts streaming KV heads were ranked on ("": by attention mass)

    @property
    def retrieval_bound_met(self) -> bool | None:
        if self.bound is None or self.original_retrieval is None or self.chosen.retrieval is None:
            return None
        return self.bound.met(self.chosen.retrieval, self.original_retrieval)

    @property
    def kv_cache_dtype(self) -> str:
        return self.chosen.choice.kv_dtype

    def to_json(self) -> str:
        """plan.json: the chosen KV dtype (what the runtime reads), the layout, the predicted bytes,
        and every candidate with its measurement."""
        c, orig = self.chosen, self.original_retrieval

        def drop(r: ServedRetrieval | None) -> float | None:
            return None if r is None or orig is None else round(r.logprob_drop(orig), 4)

        def logprobs(r: ServedRetrieval | None) -> list[float] | None:
            return None if r is None else [round(x, 4) for x in r.logprobs]

        def accuracy(r: ServedRetrieval | None) -> dict[int, float] | None:
            return None if r is None else r.accuracy()

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
            "retrieval": accuracy(c.retrieval),
            "original_retrieval": accuracy(orig),
            "retrieval_logprob_drop": drop(c.retrieval),
            "min_retrieval": None if self.bound is None else self.bound.min_retrieval,
            "max_logprob_drop": None if self.bound is None or math.isinf(self.bound.max_logprob_drop)
            else self.bound.max_logprob_drop,  # null with a bound: hits alone
            "retrieval_bound_met": self.retrieval_bound_met,
            "retrieval_prompts": self.retrieval_prompts,
            "heads_ranked_on": self.heads_ranked_on or None,
            "retrieval_logprobs": logprobs(c.retrieval),
            "original_retrieval_logprobs": logprobs(orig),
            "candidates": [{**asdict(x.choice), "kv_bytes_per_token": round(x.kv_bytes_per_token, 1),
                            "times_smaller": round(x.times_smaller, 3), "dev_ppl": x.dev_ppl,
                            "retrieval": accuracy(x.retrieval),
                            "retrieval_logprob_drop": drop(x.retrieval)}
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
    return full_attention_layout(config, ctx, "--kv-budget plans", "plan the KV layout")


def full_attention_layout(config: dict, ctx: int, what: str, instead: str) -> AttentionLayout:
    """The layout of an unquantized full-attention checkpoint without KV sharing, with ``ctx`` in its
    positions; else one line (``what``: the refusing flag's phrase, ``instead``: what to do first)."""
    if config.get("quantization_config"):
        raise KvslimError(f"checkpoint is quantized; {instead} on unquantized weights, then quantize")
    positions = int(config.get("max_position_embeddings") or 0)
    if ctx < 2 or (positions and ctx > positions):
        raise KvslimError(f"--ctx {ctx} must be between 2 and the model's context ({positions})")
    layout = AttentionLayout.from_config(config)
    if layout.sliding_layers() or layout.streaming_layers() or len(layout.cache_owners()) != layout.num_layers:
        raise KvslimError(f"{what} from a full-attention checkpoint without KV sharing "
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


def split_by_rank(ranked: list[tuple[int, int]], k: int, layers: int,
                  kv_heads: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Per layer, (the KV heads among ``ranked``'s first ``k``, the others)."""
    keep = set(ranked[:k])
    kept = tuple(tuple(h for h in range(kv_heads) if (layer, h) in keep) for layer in range(layers))
    lowered = tuple(tuple(h for h in range(kv_heads) if (layer, h) not in keep) for layer in range(layers))
    return kept, lowered


def head_candidates(config: dict, ctx: int, budget_bytes: float | None, head_ranking: dict[int, list[tuple[int, int]]],
                    original: float, dtype: str, layer_counts: dict[int, list[int]],
                    gate_ranking: dict[int, list[tuple[int, int]]] | None = None,
                    gate_label: str = GATE_RANKED) -> list[Candidate]:
    """Streaming-head choices for one dtype: per window, the most full KV heads the budget allows
    (without a budget: the full-layer ladder's counts in heads), the others streaming;
    ``head_ranking[W]``: (layer, head) by attention mass beyond W, most first; ``gate_ranking[W]``,
    when given, replaces it: by what streaming each head alone costs calibration retrieval answers
    (DuoAttention's gates, ``eval.kv_plan_measurements.gate_rank``). Bytes by allocation."""
    n, kvh = int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    out = []
    if gate_ranking:
        rankings = [(w, gate_ranking[w], gate_label) for w in head_ranking]
    else:
        rankings = [(w, ranked, "mass") for w, ranked in head_ranking.items()]
    for w, ranked, by in rankings:
        f, s = layer_bytes(config, dtype, w, ctx)
        if budget_bytes is None:
            counts = [g * kvh for g in layer_counts[w]]
        else:
            most = math.floor((budget_bytes - n * s) * kvh / (f - s)) if f > s else n * kvh - 1
            counts = [min(most, n * kvh - 1)] if most >= 0 else []
        for k in counts:
            while k >= 0:
                _, streaming = split_by_rank(ranked, k, n, kvh)  # none full: every layer sliding, as layers say
                choice = KvChoice(dtype, w, (), PLAN_SINKS, streaming, by) if k else KvChoice(dtype, w, (), PLAN_SINKS)
                nbytes = allocated_bytes(choice.config(config), dtype, ctx)
                if budget_bytes is None or nbytes <= budget_bytes:
                    out.append(Candidate(choice, nbytes, original / nbytes))
                    break
                k -= 1  # block rounding: one head fewer
    return out


def full_heads(choice: KvChoice, kv_heads: int) -> int:
    return sum(kv_heads - len(s) for s in choice.streaming)


def pruned_gate_candidates(model_dir: Path, tokenizer, prompts: list, config: dict, ctx: int, budget_bytes: float,
                           original: float, gated: list[Candidate]) -> list[Candidate]:
    """For each gate-ranked streaming-head candidate, the one as many heads buy when the gates are
    re-measured as the lowest stream (``eval.kv_plan_measurements.gate_rank(pruned_down_to=...)``),
    where its full heads differ."""
    kvh = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    down_to: dict[int, int] = {}
    for c in gated:  # one order per window: pruned down to the fewest full heads any dtype buys there
        down_to[c.choice.window] = min(down_to.get(c.choice.window, kvh * len(c.choice.streaming)),
                                       full_heads(c.choice, kvh))
    pruned = gate_rank(model_dir, tokenizer, prompts, tuple(down_to), PLAN_SINKS, down_to)
    out = []
    for c in gated:
        w = c.choice.window
        for cand in head_candidates(config, ctx, budget_bytes, {w: pruned[w]}, original, c.choice.kv_dtype, {w: []},
                                    {w: pruned[w]}, PRUNED_GATE_RANKED):
            if cand.choice.streaming != c.choice.streaming:
                out.append(cand)
    return out


def precision_head_candidates(config: dict, ctx: int, budget_bytes: float | None, original: float, dtype: str,
                              retrieval_ranking: list[tuple[int, int]]) -> list[Candidate]:
    """KV bits per head (``eval.kv_precision_heads``) for a ``HIGH/LOW`` mix: the most top-ranked
    heads in HIGH the budget allows, the rest in LOW over the whole context (without a budget: a
    fifth and two fifths of the heads in HIGH). Bytes by allocation."""
    n, kvh = int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    positions, total = int(config["max_position_embeddings"]), n * kvh

    def measured(k: int) -> Candidate:
        _, lowered = split_by_rank(retrieval_ranking, k, n, kvh)
        choice = KvChoice(dtype, positions, (), 0, lowered, "retrieval", whole_context=True)
        nbytes = allocated_bytes(choice.config(config), dtype, ctx)
        return Candidate(choice, nbytes, original / nbytes)

    if budget_bytes is None:
        return [measured(k) for k in sorted({max(1, total // 5), max(1, 2 * total // 5)}) if k < total]
    lo, hi = 0, total - 1  # the most heads in HIGH within the budget: bytes grow with k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if measured(mid).kv_bytes_per_token <= budget_bytes else (lo, mid - 1)
    best = measured(lo) if lo >= 1 else None
    return [best] if best is not None and best.kv_bytes_per_token <= budget_bytes else []


def candidates(config: dict, ctx: int, budget_bytes: float | None, ranking: dict[int, list[int]],
               original: float, dtypes: tuple[str, ...] = PLAN_DTYPES,
               head_ranking: dict[int, list[tuple[int, int]]] | None = None,
               retrieval_ranking: list[tuple[int, int]] | None = None,
               gate_ranking: dict[int, list[tuple[int, int]]] | None = None) -> list[Candidate]:
    """Every choice to serve, with its bytes: per dtype, full attention, and per window the most
    full layers the budget allows (without a budget: a ladder of full-layer counts), and with
    ``head_ranking`` the most full KV heads (``head_candidates``; by ``gate_ranking`` when given);
    for a ``HIGH/LOW`` mix with ``retrieval_ranking``, KV bits per head too
    (``precision_head_candidates``). ``ranking[W]``: the layers by attention mass beyond W, most
    first; ``original``: ``original_bytes``."""
    n = int(config["num_hidden_layers"])
    out = []
    for dtype in dtypes:
        cost = {w: layer_bytes(config, dtype, w, ctx) for w in (None, *ranking)}  # (full, sliding) per layer
        # a mix differs from its full part's dtype only where attention is windowed
        options = [] if SEPARATOR in dtype else [KvChoice(dtype)]
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
            out += head_candidates(config, ctx, budget_bytes, head_ranking, original, dtype, layer_counts,
                                   gate_ranking)
        if retrieval_ranking and SEPARATOR in dtype and config.get("max_position_embeddings"):
            out += precision_head_candidates(config, ctx, budget_bytes, original, dtype, retrieval_ranking)
    unique = {(c.choice.kv_dtype, c.choice.window, c.choice.global_layers, c.choice.streaming): c
              for c in reversed(out)}
    return sorted(unique.values(), key=lambda c: c.kv_bytes_per_token)  # fewest bytes first (one of each layout)


def plan_texts(tokenizer, ctx: int, source: str = DEFAULT_CALIB) -> tuple[Tensor, Tensor, str, str]:
    """``(ranking ids [CALIB_SEQS, ctx], dev slice ids (flat), the ranking text described, the dev
    slice described)``: the planner's calibration windows of ``source`` and the dev slice after them."""
    spec = CalibrationSpec(source=source, num_samples=CALIB_SEQS + DEV_WINDOWS, seq_len=ctx)
    tokens = token_windows(tokenizer(spec.load_text(), add_special_tokens=False)["input_ids"], spec)
    return (tokens[:CALIB_SEQS], tokens[CALIB_SEQS:].flatten(), f"{CALIB_SEQS} x {ctx} tokens of {source}",
            f"{source} tokens [{CALIB_SEQS * ctx}, {(CALIB_SEQS + DEV_WINDOWS) * ctx})")


def retrieval_prompts(tokenizer, ctx: int, samples: int = RETRIEVAL_SAMPLES,
                      tasks: tuple[str, ...] = RETRIEVAL_CALIB, depths: tuple[int, ...] = RETRIEVAL_DEPTHS,
                      first_sample: int = 0) -> list:
    """The calibration retrieval prompts at ``ctx`` (``eval.retrieval_task``, calibration wording),
    ``samples`` per task and depth from seeded index ``first_sample``."""
    from eval.retrieval_task import RetrievalTask

    return [p for name in tasks
            for p in RetrievalTask(name, (ctx,), depths, samples, first_sample).prompts(tokenizer)]


def ranking_prompts(tokenizer, ctx: int, sample: int) -> list:
    """The calibration retrieval prompts the KV heads are ranked on: one per task and depth below
    100% (a fact at the end lies in every window), the ``sample``-th of each, so that a bound
    checking ``sample`` prompts a task and depth never sees them."""
    return retrieval_prompts(tokenizer, ctx, 1, depths=RANKING_DEPTHS, first_sample=sample)


def plan_kv(model_dir: str | Path, budget: float | None = None, max_ppl_increase: float | None = None,
            ctx: int = DEFAULT_PLAN_CTX, calib: str | None = None, windows: tuple[int, ...] = PLAN_WINDOWS,
            dtypes: tuple[str, ...] = PLAN_DTYPES, progress: Callable[[str], None] = lambda _: None,
            heads: bool = True, min_retrieval: float | None = DEFAULT_MIN_RETRIEVAL,
            retrieval_samples: int = RETRIEVAL_SAMPLES, max_logprob_drop: float = DEFAULT_MAX_LOGPROB_DROP) -> KvPlan:
    """Choose the KV layout and dtype for ``model_dir`` (see the module docstring); ``heads``:
    streaming-head candidates too; ``min_retrieval``: the most a plan's calibration retrieval may fall
    below the original's at any depth (None: no retrieval bound, none measured), measured on
    ``retrieval_samples`` prompts per calibration task and depth; ``max_logprob_drop``: the most
    (nats per token) a fact the original finds may lose from its answer's log-probability."""
    ckpt = Checkpoint.open(model_dir)
    config = ckpt.config
    layout = check_request(config, budget, max_ppl_increase, ctx)
    if min_retrieval is not None and not 0 <= min_retrieval <= 1:
        raise KvslimError(f"--min-retrieval {min_retrieval} must be in [0, 1] (points of accuracy below the original)")
    if not max_logprob_drop >= 0:
        raise KvslimError(f"--max-logprob-drop {max_logprob_drop} must be >= 0 (nats per answer token; inf: hits alone)")
    if retrieval_samples < 1:
        raise KvslimError(f"--retrieval-samples must be a positive integer, got {retrieval_samples}")
    if any(w < 1 for w in windows):
        raise KvslimError(f"--plan-windows must be positive token counts, got {' '.join(map(str, windows))}")
    n = layout.num_layers
    windows = tuple(w for w in windows if w < ctx)
    tokenizer = load_tokenizer(ckpt.path)
    calib_ids, dev, calibration, dev_text = plan_texts(tokenizer, ctx, calib or DEFAULT_CALIB)
    progress(f"ranking layers and KV heads by attention mass beyond windows {list(windows)} on {calibration}")
    ranking, head_ranking = rank(ckpt.path, calib_ids, windows, PLAN_SINKS) if windows else ({}, {})
    prompts = retrieval_prompts(tokenizer, ctx, retrieval_samples) if min_retrieval is not None else []
    prompt_text = (f"{len(prompts)} prompts of {ctx} tokens: {', '.join(RETRIEVAL_CALIB)} at depths "
                   f"{', '.join(map(str, RETRIEVAL_DEPTHS))}%" if prompts else "")
    retrieval_ranking = gate_ranking = None
    ranked_on = ranking_prompts(tokenizer, ctx, retrieval_samples) if prompts and heads and windows else []
    ranking_text = (f"{len(ranked_on)} other prompts of {ctx} tokens ({', '.join(RETRIEVAL_CALIB)} at depths "
                    f"{', '.join(map(str, RANKING_DEPTHS))}%)" if ranked_on else "")
    if ranked_on:
        progress(f"ranking KV heads by what streaming each costs the answers of {ranking_text}")
        gate_ranking = gate_rank(ckpt.path, tokenizer, ranked_on, windows, PLAN_SINKS)
        if any(SEPARATOR in d for d in dtypes):
            progress("ranking KV heads by the attention the question puts on the fact, for KV bits per head")
            retrieval_ranking = retrieval_rank(ckpt.path, tokenizer, ranked_on)
    original = original_bytes(config, ctx)
    original_ppl = served_perplexity(ckpt.path, config, "bf16", dev, dev_text, ctx)
    original_ret = served_retrieval(ckpt.path, config, "bf16", prompts, tokenizer, ctx) if prompts else None
    bound = RetrievalBound(min_retrieval, max_logprob_drop) if prompts else None
    progress(f"original (bf16 KV): {original:,.0f} B/token @{ctx}, dev ppl {original_ppl:.3f}"
             + (f", retrieval by depth {by_depth_line(original_ret.accuracy())}" if original_ret else ""))
    todo = candidates(config, ctx, None if budget is None else budget * original, ranking, original, dtypes,
                      head_ranking if heads else None, retrieval_ranking, gate_ranking)
    if not todo:
        raise KvslimError(f"no KV plan fits {budget:g} of the original's bytes at context {ctx} (the smallest: "
                          f"{min(dtypes, key=_bits)} with every layer sliding over the shortest window)")

    checks = 0

    def retrieval_ok(cand: Candidate) -> tuple[Candidate, bool]:
        nonlocal checks
        if not prompts:
            return cand, True
        checks += 1
        cand = replace(cand, retrieval=served_retrieval(ckpt.path, cand.choice.config(config), cand.choice.kv_dtype,
                                                        prompts, tokenizer, ctx))
        ok = bound.met(cand.retrieval, original_ret)
        progress(f"  retrieval of {cand.choice.describe(n)}: {bound.kept(cand.retrieval, original_ret)} "
                 f"({'within' if ok else 'NOT within'} the bound: {bound.describe()})")
        return cand, ok

    def dev_served(cand: Candidate) -> Candidate:
        ppl = served_perplexity(ckpt.path, cand.choice.config(config), cand.choice.kv_dtype, dev, dev_text, ctx)
        progress(f"{cand.choice.describe(n)}: {cand.kv_bytes_per_token:,.0f} B/token "
                 f"({cand.times_smaller:.2f}x smaller), dev ppl {ppl:.3f} ({100 * (ppl / original_ppl - 1):+.2f}%)")
        return replace(cand, dev_ppl=ppl)

    served, chosen = [], None
    for cand in todo:
        cand = dev_served(cand)
        ppl = cand.dev_ppl
        if max_ppl_increase is not None and ppl <= original_ppl * (1 + max_ppl_increase):
            if checks >= RETRIEVAL_CHECKS:
                served.append(cand)
                break
            cand, ok = retrieval_ok(cand)
            served.append(cand)
            if ok:
                chosen = cand
                break
            continue
        served.append(cand)
    if budget is not None:  # the best dev perplexity within the retrieval bound
        ranked = sorted(served, key=lambda c: c.dev_ppl)
        checked = []
        for cand in ranked[:RETRIEVAL_CHECKS]:
            cand, ok = retrieval_ok(cand)
            checked.append(cand)
            if ok:
                chosen = cand
                break
        gated = [c for c in todo if c.choice.heads_by == GATE_RANKED]
        if chosen is None and gated:  # the heads ranked again where the plan operates, before settling
            progress(f"no candidate checked keeps retrieval within the bound: ranking KV heads again on "
                     f"{ranking_text}, the gates re-measured as the lowest-scored heads stream")
            for cand in pruned_gate_candidates(ckpt.path, tokenizer, ranked_on, config, ctx, budget * original,
                                               original, gated):
                cand, ok = retrieval_ok(dev_served(cand))
                served.append(cand)
                checked.append(cand)
                if ok and (chosen is None or cand.dev_ppl < chosen.dev_ppl):
                    chosen = cand
        if chosen is None:  # the bound missed by all checked: the best worst depth, then dev perplexity
            chosen = max(checked, key=lambda c: (bound.hit_margin(c.retrieval, original_ret), -c.dev_ppl))
            progress(f"no candidate checked keeps retrieval within the bound ({bound.describe()}): chose the best "
                     f"dev perplexity among those whose worst depth keeps the most "
                     f"({bound.kept(chosen.retrieval, original_ret)})")
        by_choice = {c.choice: c for c in checked}
        served = [by_choice.get(c.choice, c) for c in served]
    elif chosen is None:
        passing = [c for c in served if c.dev_ppl <= original_ppl * (1 + max_ppl_increase)]
        if not passing:
            raise KvslimError(f"no KV plan stays within +{100 * max_ppl_increase:g}% dev perplexity "
                              f"(the best: {min(served, key=lambda c: c.dev_ppl).dev_ppl:.3f} vs {original_ppl:.3f})")
        raise KvslimError(f"no KV plan within +{100 * max_ppl_increase:g}% dev perplexity keeps calibration retrieval "
                          f"within {bound.describe()} ({checks} checked; --min-retrieval 1 plans by perplexity alone)")
    return KvPlan(ctx, budget, max_ppl_increase, n, original, original_ppl, chosen, tuple(served),
                  calibration, dev_text, original_ret, bound, prompt_text, ranking_text)


def _bits(dtype: str) -> float:
    return {"int2": 2, "k3v2": 2.5, "k4v2": 3, "int4": 4, "int8": 8}.get(dtype, 16)  # keys' and values' mean


def write_planned_checkpoint(model_dir: str | Path, plan: KvPlan, out: str | Path, force: bool = False) -> Path:
    """The checkpoint with the plan's layout (``compress convert``'s sliding rewrite and sinks) and
    ``plan.json``, written atomically."""
    choice = plan.chosen.choice
    if choice.window is not None:
        spec = ConvertSpec(sliding_window=choice.window, global_layers=choice.global_layers, sinks=choice.sinks)
        if choice.streaming is not None:
            spec = ConvertSpec(sliding_window=choice.window, sinks=choice.sinks, streaming_set=choice.streaming)
        return convert(Path(model_dir), spec, Path(out), force=force, extra_files={PLAN_FILE: plan.to_json()}).out
    return write_plan_beside_weights(model_dir, plan.to_json(), out, force)


def write_plan_beside_weights(model_dir: str | Path, plan_json: str, out: str | Path, force: bool = False) -> Path:
    """``out``: the checkpoint's files unchanged, its ``plan.json`` replaced by ``plan_json``; atomic."""
    from foundation.atomic import atomic_output_dir, check_output_dir

    ckpt = Checkpoint.open(model_dir)
    check_output_dir(Path(out), force)
    with atomic_output_dir(out, force, checked=True) as tmp:
        for f in ckpt.path.iterdir():
            if f.is_file() and f.name != PLAN_FILE:
                shutil.copy2(f, tmp / f.name)
        (tmp / PLAN_FILE).write_text(plan_json)
    return Path(out)
