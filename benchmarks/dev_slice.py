"""The calibration dev slice: calibration text that no calibration window covers, for choosing
defaults without reading evaluation text (``int4_default_choice.py``)."""
from __future__ import annotations

from pathlib import Path

import torch

from foundation.perplexity import (
    DEFAULT_CONTEXT,
    DEFAULT_STRIDE,
    hf_logits_fn,
    perplexity,
    tokenize_range,
)

CALIB = "wikipedia:calib"
SEQ_LEN = 512


def dev_slice(model_dir: Path, samples: int, dev_tokens: int) -> tuple[torch.Tensor, str]:
    """``(ids, name)``: the ``dev_tokens`` tokens of ``wikipedia:calib`` after ``samples`` windows
    of ``SEQ_LEN`` tokens."""
    from transformers import AutoTokenizer

    start = samples * SEQ_LEN
    ids = tokenize_range(AutoTokenizer.from_pretrained(model_dir), CALIB, max_tokens=start + dev_tokens)
    dev = ids[start:]
    if dev.numel() < dev_tokens:
        raise SystemExit(f"{CALIB} holds {ids.numel()} tokens: too few for {samples} windows + {dev_tokens} dev tokens")
    return dev, f"{CALIB} tokens [{start}, {start + dev.numel()})"


def dev_perplexity(model, dev: torch.Tensor, name: str) -> float:
    """Perplexity (context 512, stride 256) of a transformers model on the dev slice."""
    return perplexity(hf_logits_fn(model), dev, name, DEFAULT_CONTEXT, DEFAULT_STRIDE, progress=False).perplexity


def dev_model(dev_tokens: int, attn_implementation: str = "sdpa"):
    """``(model_dir, ids, name, model)``: the default model's dir, ``dev_tokens`` of the dev slice
    after the 64 GPTQ calibration windows, and the model in fp32 transformers (eval mode)."""
    from transformers import AutoModelForCausalLM

    from foundation.model_source import resolve_model

    path = resolve_model("smollm2")
    ids, name = dev_slice(path, 64, dev_tokens)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation=attn_implementation).eval()
    return path, ids, name, model
