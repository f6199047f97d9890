"""Which variant of a packed KV dtype a model retrieves best with, chosen on calibration prompts.

The runtime's storage rules per code width (``runtime.cache.low_bit_kv``) were measured on the
default model. Another model may read a fact stated once better otherwise: Gemma-3-270M's int4
keeps the answer likelier with each sequence's first block (its attention sinks) exact, which
SmolLM2's int4 does not need. So ``compress convert --kv-cache-dtype int4:auto`` serves each
candidate variant (``foundation.kv_dtype_mix.KV_VARIANTS``) and measures the mean answer
log-probability of calibration retrieval prompts (``eval.retrieval_task``'s ``*_calib`` wordings,
disjoint from the evaluation tasks) at the context asked, as ``LLM`` serves them
(``eval.retrieval_logprob``). The rule: the cheapest candidate (KV bytes per token at that
context) within ``LOGPROB_TOLERANCE`` of the best; on equal bytes the runtime's default first.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from foundation.errors import KvslimError

# variants tried beside the default, where they change a packed part of the dtype
CANDIDATE_VARIANTS = (("exact-first-block",), ("keys-unrotated",), ("exact-first-block", "keys-unrotated"))
LOGPROB_TOLERANCE = 0.01  # nats of mean answer log-probability
CHOICE_SAMPLES = 4  # prompts per task and depth
PREFILL_CHUNK = 1024  # LLM's default


@dataclass(frozen=True)
class VariantCandidate:
    """One KV dtype name measured: its bytes per token and its calibration answer log-probability."""

    kv_dtype: str
    kv_bytes_per_token: float
    calib_logprob: float | None  # None: the only candidate, not measured


@dataclass(frozen=True)
class KvVariantChoice:
    """The candidates measured at ``ctx`` and the one chosen."""

    chosen: VariantCandidate
    candidates: tuple[VariantCandidate, ...]
    ctx: int
    original_kv_bytes_per_token: float  # bf16 KV
    prompts: str

    @property
    def times_smaller(self) -> float:
        return self.original_kv_bytes_per_token / self.chosen.kv_bytes_per_token

    def plan(self) -> dict:
        """``plan.json``'s content: the chosen KV dtype (what the runtime serves) and the evidence."""
        return {"kv_cache_dtype": self.chosen.kv_dtype, "ctx": self.ctx, "choice": self.chosen.kv_dtype,
                "kv_bytes_per_token": round(self.chosen.kv_bytes_per_token, 1),
                "original_kv_bytes_per_token": round(self.original_kv_bytes_per_token, 1),
                "times_smaller": round(self.times_smaller, 3),
                "variant_rule": f"cheapest within {LOGPROB_TOLERANCE} of the best calibration answer log-probability",
                "retrieval_prompts": self.prompts,
                "candidates": [asdict(c) for c in self.candidates]}


def candidate_dtypes(kv_dtype: str) -> list[str]:
    """``kv_dtype`` (no variants) and each ``CANDIDATE_VARIANTS`` of it that changes how it is stored."""
    from foundation.kv_dtype_mix import KvDtypeMix, split_variants
    from runtime.cache.kv_cache import CACHE_DTYPES
    from runtime.cache.packed_recipe import packed_recipes

    mix = KvDtypeMix.parse(kv_dtype, CACHE_DTYPES)
    if mix.variants:
        raise KvslimError(f"{kv_dtype}: name the dtype alone to choose its variant (e.g. {split_variants(kv_dtype)[0]})")
    names = [mix.name]
    for variants in CANDIDATE_VARIANTS:
        try:
            packed_recipes(mix.dtypes, variants)
        except KvslimError:  # a variant that changes nothing here
            continue
        names.append(KvDtypeMix(mix.full, mix.windowed, variants).name)
    return names


def pick(candidates: list[VariantCandidate]) -> VariantCandidate:
    """The cheapest candidate within ``LOGPROB_TOLERANCE`` of the best; the earliest on equal bytes."""
    best = max(c.calib_logprob for c in candidates)
    close = [c for c in candidates if c.calib_logprob >= best - LOGPROB_TOLERANCE]
    return min(close, key=lambda c: c.kv_bytes_per_token)  # min keeps the first of equals


def named_kv_dtype(model_dir: str | Path, kv_dtype: str, ctx: int) -> KvVariantChoice:
    """``kv_dtype`` as named (variants too), nothing served: its bytes at ``ctx`` beside bf16's."""
    layout = _layout(model_dir)
    only = VariantCandidate(kv_dtype, _bytes_per_token(layout, kv_dtype, ctx), None)
    return KvVariantChoice(only, (only,), ctx, _bytes_per_token(layout, "bf16", ctx), "none: named, not chosen")


def choose_kv_variant(model_dir: str | Path, kv_dtype: str, ctx: int, samples: int = CHOICE_SAMPLES,
                      progress: Callable[[str], None] = print) -> KvVariantChoice:
    """Serve each candidate variant of ``kv_dtype`` on the calibration retrieval prompts at ``ctx``
    and choose by ``pick`` (nothing served where there is no other candidate)."""
    names = candidate_dtypes(kv_dtype)
    if len(names) == 1:
        return named_kv_dtype(model_dir, names[0], ctx)
    layout = _layout(model_dir)
    measured = []
    logprobs, described = _served_logprobs(model_dir, ctx, samples)
    for name in names:
        measured.append(VariantCandidate(name, _bytes_per_token(layout, name, ctx), logprobs(name)))
        progress(f"{name}: calibration answer log-prob {measured[-1].calib_logprob:.3f}, "
                 f"KV {measured[-1].kv_bytes_per_token:,.0f} B/token @{ctx}")
    return KvVariantChoice(pick(measured), tuple(measured), ctx, _bytes_per_token(layout, "bf16", ctx), described)


def _layout(model_dir: str | Path):
    from foundation.attention_layout import AttentionLayout
    from foundation.checkpoint import Checkpoint

    return AttentionLayout.from_config(Checkpoint.open(model_dir).config)


def _bytes_per_token(layout, kv_dtype: str, ctx: int) -> float:
    from runtime.cache.kv_cache import KVCacheSpec
    from runtime.cache.low_bit_kv import default_block_size

    return KVCacheSpec.from_layout(layout, kv_dtype, default_block_size(kv_dtype)).kv_bytes_per_token(layout, ctx)


def _served_logprobs(model_dir: str | Path, ctx: int, samples: int) -> tuple[Callable[[str], float], str]:
    """(KV dtype -> mean answer log-probability of the calibration prompts served in it, the prompts described)."""
    from eval.kv_plan import RETRIEVAL_CALIB, RETRIEVAL_DEPTHS, retrieval_prompts
    from eval.retrieval_logprob import answer_ids, served_answers
    from runtime.engine.engine import Engine
    from runtime.llm import LLM

    llm = LLM(model_dir)
    prompts = retrieval_prompts(llm.tokenizer, ctx, samples)  # the planner's calibration tasks and depths
    encoded = [answer_ids(llm.tokenizer, p.text, p.answer) for p in prompts]
    longest = max(len(a) + len(b) for a, b in encoded)
    if longest > llm.max_model_len:
        raise KvslimError(f"--ctx {ctx}: calibration prompts of up to {longest} tokens exceed the model's "
                          f"{llm.max_model_len} positions")

    def logprob(name: str) -> float:
        engine = Engine.sized_for(llm.model, longest, 1, max_num_batched_tokens=PREFILL_CHUNK, kv_dtype=name)
        means = [lp for lp, _ in served_answers(engine, encoded, PREFILL_CHUNK)]
        return sum(means) / len(means)

    return logprob, (f"{len(prompts)} prompts ({', '.join(RETRIEVAL_CALIB)}, {samples} a depth at "
                     f"{' '.join(f'{d}%' for d in RETRIEVAL_DEPTHS)}, context {ctx}), served")
