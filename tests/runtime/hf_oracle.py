"""The oracles the runtime is checked against: transformers' own models on the same checkpoint,
and our runtime driven the way the engine drives it (prefill, chunks, single-token decode)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from attention_variants.modeling_files import CAUSAL_LM_CLASSES, MODELING_DIR, MODELING_FILE
from runtime.contiguous_cache import ContiguousKVCache
from runtime.models.decoder import Decoder


def _kvslim_modeling():
    spec = importlib.util.spec_from_file_location("kvslim_modeling_for_tests", MODELING_DIR / MODELING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_model(path: Path, dtype: torch.dtype = torch.float32, ours: bool = False):
    """transformers' model for a checkpoint; ``ours``: the class of our modeling file (the
    oracle for layouts plain transformers cannot express), imported from the repository."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not ours:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(path)
    cls = getattr(_kvslim_modeling(), CAUSAL_LM_CLASSES[config.model_type])
    return cls.from_pretrained(path, dtype=dtype).eval()


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` of one sequence."""
    return model(ids[None]).logits[0].float()


@torch.no_grad()
def runtime_logits(model: Decoder, ids: torch.Tensor, splits: tuple[int, ...] = ()) -> torch.Tensor:
    """Our logits for every position of ``ids``, fed in pieces: a prefill up to ``splits[0]``,
    then chunks up to each further split, then one token at a time."""
    cache = ContiguousKVCache(model.spec, model.dtype)
    cache.add_sequence(0, len(ids))
    bounds = [0, *splits] if splits else [0, len(ids)]
    pieces = [(a, b) for a, b in zip(bounds, bounds[1:])] + [(t, t + 1) for t in range(bounds[-1], len(ids))]
    out = []
    for a, b in pieces:
        positions = cache.begin_step([(0, b - a)])
        out.append(model.compute_logits(model(ids[a:b], positions, cache)))
    return torch.cat(out)


@pytest.fixture(autouse=False)
def single_thread():
    """Run a test on one intra-op thread: tiny models gain nothing from two, and on a shared,
    oversubscribed CPU two OpenMP threads spin-wait on each other (20x slower measured here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
