"""Tiny random checkpoints of every supported architecture, built from configs (no downloads)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

BASE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str, **overrides):
    """A transformers config object for a tiny model of ``model_type``."""
    from transformers import AutoConfig

    kw = dict(BASE)
    if model_type == "mistral":
        kw["sliding_window"] = 64
    if model_type == "qwen2":
        kw["use_sliding_window"] = False
    if model_type == "gemma3_text":
        kw.update(
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def make_tiny_checkpoint(
    out: Path, model_type: str = "llama", seed: int = 0, tokenizer_from: Path | None = None, **overrides
) -> Path:
    """Write a random tiny causal LM of ``model_type`` to ``out`` in fp32 safetensors.

    ``tokenizer_from``: copy tokenizer files from that checkpoint (the vocab must then match).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Scale up the random init a little so logits are not all near-uniform.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_from is not None:
        for f in Path(tokenizer_from).glob("tokenizer*"):
            shutil.copy2(f, out / f.name)
    return out


def damaged_copy(
    src: Path, dst: Path, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None
) -> Path:
    """Copy checkpoint ``src`` (one ``model.safetensors``) to ``dst`` without the tensors ``drop``
    and with ``put``'s tensors added or replacing theirs."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = {k: v for k, v in load_file(dst / "model.safetensors").items() if k not in drop}
    weights.update(put or {})
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return Path(dst)
