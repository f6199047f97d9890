"""What a conversion bought and cost: KV bytes per token and unhealed held-out perplexity."""
from __future__ import annotations

from pathlib import Path

import torch

from attention_variants.modeling_files import checkpoint_code_is_ours
from foundation.attention_layout import AttentionLayout
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.perplexity import (
    PerplexityResult,
    hf_logits_fn,
    perplexity,
    tokenize_range,
)
from foundation.texts import DEFAULT_EVAL

EVAL_CONTEXT = 1024  # sliding-window figures need context beyond the window
EVAL_STRIDE = 512
BF16 = 2


def load_for_eval(checkpoint: Path):
    """Load a checkpoint in plain transformers; remote code only when it is our modeling file."""
    from transformers import AutoModelForCausalLM

    trust = checkpoint_code_is_ours(checkpoint)
    if any(Path(checkpoint).glob("*.py")) and not trust:
        raise KvslimError(f"{checkpoint}: carries modeling code that is not kvslim's; refusing to run it")
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, trust_remote_code=trust).eval()


def eval_perplexity(checkpoint: Path, num_tokens: int, text: str = DEFAULT_EVAL,
                    context: int = EVAL_CONTEXT, stride: int = EVAL_STRIDE) -> PerplexityResult:
    """Perplexity of a checkpoint on the first ``num_tokens`` of ``text`` (the shared function)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenize_range(tokenizer, text, max_tokens=num_tokens)
    return perplexity(hf_logits_fn(load_for_eval(checkpoint)), ids, text, context=context, stride=stride)


def kv_line(layout: AttentionLayout, context: int) -> str:
    per_token = layout.kv_bytes_per_token(context, BF16)
    return f"{per_token / 1024:.2f} KiB/token (bf16, context {context})"


def print_summary(source: Path, result, spec, eval_tokens: int) -> None:
    """Print the conversion summary (layout, KV bytes before/after, unhealed perplexity)."""
    before, after = result.before, result.after
    print(f"converted {source} -> {result.out}: {spec.describe()}")
    if result.calibration:
        print(f"  calibration: {result.calibration}")
    owners = len(after.cache_owners())
    sinks = max((l.sinks for l in after.layers), default=0)
    streaming = [l.streaming for l in after.layers if l.streaming is not None]
    heads = sum(s.num_kv_heads for s in streaming)
    streams = (f", {heads}/{after.num_layers * after.num_kv_heads} KV heads streaming (window {streaming[0].window} + "
               f"{streaming[0].sinks} sinks) in {len(streaming)} layers") if streaming else ""
    print(f"  layout: {after.num_kv_heads} KV heads, {owners}/{after.num_layers} layers own a cache, "
          f"{len(after.sliding_layers())} sliding{f' ({sinks} sinks)' if sinks else ''}{streams}")
    if sinks and before.sliding_layers():
        print("  note: this model was trained with these sliding windows and never saw sinks there; measure before "
              "serving (Gemma-3-270M at context 2,048: wikipedia:eval perplexity 19.08 -> 127.9, BENCHMARKS.md)")
    max_context = int(Checkpoint.open(source).config.get("max_position_embeddings") or EVAL_CONTEXT)
    for context in sorted({EVAL_CONTEXT, max_context}):
        b, a = before.kv_bytes_per_token(context, BF16), after.kv_bytes_per_token(context, BF16)
        print(f"  KV cache: {kv_line(before, context)} -> {kv_line(after, context)} ({b / a:.2f}x smaller)")
    if eval_tokens > 0:
        ppl_before = eval_perplexity(source, eval_tokens)
        ppl_after = eval_perplexity(result.out, eval_tokens)
        print(f"  original:  {ppl_before.describe()}")
        print(f"  converted: {ppl_after.describe()} (unhealed)")
