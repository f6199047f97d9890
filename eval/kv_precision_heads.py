"""KV bits per head: the heads that retrieve keep the higher precision, the rest store the lower one.

``compress convert MODEL --kv-cache-dtype HIGH/LOW --retrieval-heads F``. INT2 KV loses a fact stated
once (BENCHMARKS section 3) because every head's keys lose it; a few heads carry retrieval
(DuoAttention's retrieval heads, Wu et al.'s retrieval heads). So the share ``F`` of the KV heads
the question's attention finds the fact through (``attention_variants.retrieval_heads``, on
calibration passkey and needle prompts: ``eval.retrieval_task``'s ``*_calib`` wordings, disjoint
from the evaluation tasks) keep ``HIGH``; the others store ``LOW``, every head still attending to
the whole context.

The layout is streaming heads (``foundation.attention_layout``) whose window is the model's every
position and which keep no sinks: attention exactly as before, the heads in their own cache group,
which a ``FULL/WINDOWED`` KV dtype mix stores in its second dtype. The checkpoint's ``plan.json``
names the mix, so every runtime entry point serves it so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from foundation.errors import KvslimError
from foundation.kv_dtype_mix import SEPARATOR, split_variants

RANKING_SAMPLES = 4  # calibration prompts per task and depth the heads are ranked on


@dataclass(frozen=True)
class PrecisionHeads:
    """Which KV heads keep the mix's first dtype, and the bytes that costs at ``ctx``."""

    kv_dtype: str  # "HIGH/LOW"
    kept: tuple[tuple[int, ...], ...]  # per layer, the KV heads stored in HIGH
    lowered: tuple[tuple[int, ...], ...]  # per layer, the KV heads stored in LOW
    window: int  # the lowered heads' window: the model's positions, so the whole context
    ctx: int
    kv_bytes_per_token: float  # at ctx, by allocation
    original_kv_bytes_per_token: float  # bf16 KV, every head
    prompts: str

    @property
    def times_smaller(self) -> float:
        return self.original_kv_bytes_per_token / self.kv_bytes_per_token

    def describe(self) -> str:
        high, low = split_variants(self.kv_dtype)[0].split(SEPARATOR)
        kept, total = sum(map(len, self.kept)), sum(map(len, self.kept)) + sum(map(len, self.lowered))
        return f"{high} KV for the {kept} of {total} KV heads that retrieve, {low} for the rest (whole context)"

    def plan(self) -> dict:
        """``plan.json``'s content: the KV dtype the runtime serves, the heads, and the evidence."""
        return {"kv_cache_dtype": self.kv_dtype, "ctx": self.ctx, "choice": self.describe(),
                "retrieval_kv_heads": [list(h) for h in self.kept],
                "kv_bytes_per_token": round(self.kv_bytes_per_token, 1),
                "original_kv_bytes_per_token": round(self.original_kv_bytes_per_token, 1),
                "times_smaller": round(self.times_smaller, 3), "retrieval_prompts": self.prompts}


def check_request(config: dict, kv_dtype: str, fraction: float, ctx: int) -> tuple[int, int]:
    """One line for what cannot be split by head; else (layers, KV heads per layer)."""
    from eval.kv_plan import full_attention_layout
    from foundation.kv_dtype_mix import KvDtypeMix
    from runtime.cache.kv_cache import CACHE_DTYPES

    mix = KvDtypeMix.parse(kv_dtype, CACHE_DTYPES)
    if mix.full == mix.windowed:
        raise KvslimError(f"--retrieval-heads needs --kv-cache-dtype HIGH/LOW (e.g. int4/int2: the retrieval heads "
                          f"in int4, the rest in int2), not {kv_dtype}")
    if not 0 < fraction < 1:
        raise KvslimError(f"--retrieval-heads {fraction:g} must be a share of the KV heads in (0, 1)")
    if not config.get("max_position_embeddings"):
        raise KvslimError("config has no max_position_embeddings: the lowered heads' whole-context window is unknown")
    layout = full_attention_layout(config, ctx, "--retrieval-heads works", "split KV heads")
    return layout.num_layers, layout.layers[0].num_kv_heads


def choose_precision_heads(model_dir: str | Path, kv_dtype: str, fraction: float, ctx: int,
                           samples: int = RANKING_SAMPLES, tasks: tuple[str, ...] | None = None,
                           progress: Callable[[str], None] = print) -> PrecisionHeads:
    """Rank the KV heads on calibration retrieval prompts at ``ctx`` (``tasks``: the planner's,
    ``eval.kv_plan.RETRIEVAL_CALIB``, unless named) and keep the top ``fraction``."""
    from eval.kv_plan import (RETRIEVAL_CALIB, KvChoice, allocated_bytes, original_bytes, retrieval_prompts,
                              split_by_rank)
    from eval.kv_plan_measurements import retrieval_rank
    from foundation.calibration import load_tokenizer
    from foundation.checkpoint import Checkpoint

    ckpt = Checkpoint.open(model_dir)
    layers, heads = check_request(ckpt.config, kv_dtype, fraction, ctx)
    if samples < 1:
        raise KvslimError(f"--retrieval-samples must be at least 1, got {samples}")
    tokenizer = load_tokenizer(ckpt.path)
    tasks = tasks or RETRIEVAL_CALIB
    prompts = retrieval_prompts(tokenizer, ctx, samples, tasks)
    described = (f"{len(prompts)} prompts of {ctx} tokens ({', '.join(tasks)}, {samples} a depth); "
                 "KV heads ranked by the attention the question puts on the fact")
    progress(f"ranking KV heads on {described.split(';')[0]}")
    ranked = retrieval_rank(ckpt.path, tokenizer, prompts)
    kept, lowered = split_by_rank(ranked, min(layers * heads - 1, max(1, round(fraction * layers * heads))),
                                  layers, heads)
    window = int(ckpt.config["max_position_embeddings"])
    layout = KvChoice(kv_dtype, window, (), 0, lowered).config(ckpt.config)
    return PrecisionHeads(kv_dtype, kept, lowered, window, ctx, allocated_bytes(layout, kv_dtype, ctx),
                          original_bytes(ckpt.config, ctx), described)


def write_precision_heads(model_dir: str | Path, heads: PrecisionHeads, out: str | Path, force: bool = False) -> Path:
    """The checkpoint with the lowered heads in their own cache group and ``plan.json``; atomic."""
    import json

    from attention_variants.convert import ConvertSpec, convert
    from foundation.kv_plan_file import PLAN_FILE

    spec = ConvertSpec(sliding_window=heads.window, sinks=0, streaming_set=heads.lowered)
    plan = json.dumps(heads.plan(), indent=2) + "\n"
    return convert(Path(model_dir), spec, Path(out), force=force, extra_files={PLAN_FILE: plan}).out
