"""The oracles the runtime is checked against: transformers' own models on the same checkpoint,
and our runtime driven the way the engine drives it (prefill, chunks, single-token decode)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from attention_variants.modeling_files import (
    CAUSAL_LM_CLASSES,
    MODELING_DIR,
    MODELING_FILE,
)
from runtime.engine.engine import Engine
from runtime.model.decoder import Decoder


def _kvslim_modeling():
    spec = importlib.util.spec_from_file_location("kvslim_modeling_for_tests", MODELING_DIR / MODELING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_model(path: Path, dtype: torch.dtype = torch.float32, ours: bool = False):
    """transformers' model for a checkpoint; ``ours``: the class of our modeling file (the
    oracle for layouts plain transformers cannot express), imported from the repository."""
    from transformers import AutoModelForCausalLM

    if not ours:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # config.json's model_type: AutoConfig reads a Mistral config with layer_types as "ministral"
    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    cls = getattr(_kvslim_modeling(), CAUSAL_LM_CLASSES[model_type])
    return cls.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` of one sequence."""
    return model(ids[None]).logits[0].float()


@torch.no_grad()
def runtime_logits(model: Decoder, ids: torch.Tensor, splits: tuple[int, ...] = ()) -> torch.Tensor:
    """Our logits for every position of ``ids`` through the engine's paged cache, fed in pieces:
    a prefill up to ``splits[0]``, then chunks up to each further split, then one token at a time."""
    bounds = [0, *splits] if splits else [0, len(ids)]
    pieces = [b - a for a, b in zip(bounds, bounds[1:])] + [1] * (len(ids) - bounds[-1])
    engine = Engine.sized_for(model, len(ids), 1, max_num_batched_tokens=max(pieces))
    return engine.score(ids.tolist(), pieces)


@pytest.fixture(autouse=False)
def single_thread():
    """Run a test on one intra-op thread: tiny models gain nothing from two, and on a shared,
    oversubscribed CPU two OpenMP threads spin-wait on each other (20x slower measured here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


NEAR_TIE = 1e-3  # logit gap below which two greedy choices are a tie up to rounding


@torch.no_grad()
def assert_greedy_matches_hf(model, prompt_ids: list[int], tokens: list[int]) -> int:
    """Check our greedy ``tokens`` against transformers' argmax, step by step (its own KV cache).
    Returns how many tokens agreed; a disagreement is allowed only at a near-tie (HF's top-2
    logits closer than ``NEAR_TIE``), after which the sequences may diverge."""
    out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
    for i, tok in enumerate(tokens):
        top2 = out.logits[0, -1].float().topk(2)
        if tok != int(top2.indices[0]):
            gap = float(top2.values[0] - top2.values[1])
            assert gap < NEAR_TIE, f"step {i}: ours {tok}, transformers {int(top2.indices[0])} (gap {gap:.2e})"
            return i
        out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return len(tokens)
