"""What the KV planner (``eval.kv_plan``) measures: layers and KV heads ranked on calibration text
and retrieval prompts, and each candidate served by the runtime (its paged cache really quantized
and read back) for perplexity and retrieval."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from eval.retrieval_bound import ServedRetrieval


def rank(model_dir: Path, ids: torch.Tensor, windows: tuple[int, ...],
         sinks: int) -> tuple[dict[int, list[int]], dict[int, list[tuple[int, int]]]]:
    """Per window (with ``sinks`` attention sinks), the layers and the (layer, KV head) pairs by
    attention mass beyond it on ``ids`` (most first), from one pass (``head_scores_by_window``; a
    layer's mass is its heads' mean, the rule ``--global-select calib`` ranks layers by)."""
    from transformers import AutoModelForCausalLM

    from attention_variants.streaming_heads import head_scores_by_window

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers, heads = {}, {}
    for w, scores in head_scores_by_window(model, ids, windows, sinks).items():
        mass = scores["mass"]
        layers[w] = mass.mean(1).argsort(descending=True, stable=True).tolist()
        heads[w] = [divmod(int(i), mass.shape[1]) for i in mass.flatten().argsort(descending=True, stable=True)]
    return layers, heads


@contextmanager
def served_engine(model_dir: Path, config: dict, kv_dtype: str, ctx: int):
    """The runtime's engine over the checkpoint's weights under ``config`` (the layout a candidate
    rewrites), its paged cache in ``kv_dtype``, room for one ``ctx``-token sequence."""
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import load_model

    with tempfile.TemporaryDirectory(prefix="kvslim-plan-") as tmp:
        for f in Path(model_dir).iterdir():  # the weights as they are, the layout from config
            if f.name != "config.json":
                os.symlink(f.resolve(), Path(tmp) / f.name)
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = load_model(Path(tmp), "auto")
        room = min(ctx + 32, model.spec.max_position_embeddings)
        yield Engine(model, EngineConfig(kv_dtype=kv_dtype, max_num_batched_tokens=ctx, max_model_len=room,
                                         max_num_seqs=4, kv_cache_bytes=max(64, ctx // 8) << 20))


def served_perplexity(model_dir: Path, config: dict, kv_dtype: str, ids: torch.Tensor, text: str, ctx: int) -> float:
    """Perplexity of ``ids`` at context ``ctx`` (stride ctx/2) through the runtime's paged cache,
    the checkpoint's weights under ``config``."""
    from foundation.perplexity import perplexity

    with served_engine(model_dir, config, kv_dtype, ctx) as engine:
        return perplexity(None, ids, text, context=ctx, stride=max(1, ctx // 2),
                          logprobs_fn=lambda x: engine.score_targets(x[0])).perplexity


def served_retrieval(model_dir: Path, config: dict, kv_dtype: str, prompts: list, tokenizer,
                     ctx: int) -> ServedRetrieval:
    """Each retrieval prompt's answer, served by the runtime with the cache as the candidate holds it:
    its tokens' mean log-probability (teacher-forced, the prompt prefilled as one chunk) and whether
    greedy decoding gives it (``eval.retrieval_logprob.served_answers``)."""
    from eval.retrieval_logprob import answer_ids, served_answers

    encoded = [answer_ids(tokenizer, p.text, p.answer) for p in prompts]
    with served_engine(model_dir, config, kv_dtype, ctx) as engine:
        answers = served_answers(engine, encoded, ctx)
    return ServedRetrieval(tuple(p.depth for p in prompts), tuple(lp for lp, _ in answers),
                           tuple(hit for _, hit in answers))


def gate_rank(model_dir: Path, tokenizer, prompts: list, windows: tuple[int, ...],
              sinks: int, pruned_down_to: dict[int, int] | None = None) -> dict[int, list[tuple[int, int]]]:
    """Per window, (layer, KV head) by how much streaming the head alone would cost the prompts'
    answers (the gradient of their log-probability at DuoAttention's gate,
    ``attention_variants.retrieval_gates``), most first; ``pruned_down_to[W]``: the gates re-measured
    as the lowest stream until that many heads are full (``pruned_gate_order``, a pass per step)."""
    from transformers import AutoModelForCausalLM

    from attention_variants.retrieval_gates import pruned_gate_order, retrieval_gate_scores
    from eval.retrieval_logprob import answer_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = [answer_ids(tokenizer, p.text, p.answer) for p in prompts]
    if pruned_down_to is not None:
        return {w: pruned_gate_order(model, encoded, w, sinks, down_to=pruned_down_to[w]) for w in windows}
    scores = retrieval_gate_scores(model, encoded, windows, sinks)
    return {w: [divmod(int(i), s.shape[1]) for i in s.flatten().argsort(descending=True, stable=True)]
            for w, s in scores.items()}


def retrieval_rank(model_dir: Path, tokenizer, prompts: list) -> list[tuple[int, int]]:
    """(layer, KV head) by the attention the question puts on the fact, most first
    (``attention_variants.retrieval_heads``), over the prompts whose fact is not at the end."""
    from transformers import AutoModelForCausalLM

    from attention_variants.retrieval_heads import retrieval_head_scores

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scores = retrieval_head_scores(model, tokenizer, [p for p in prompts if p.depth < 100])
    return [divmod(int(i), scores.shape[1]) for i in scores.flatten().argsort(descending=True, stable=True)]
