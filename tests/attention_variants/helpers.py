"""Shared test helpers: build tiny checkpoints with chosen weights, run rewrites, compare logits."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from attention_variants.attention_inputs import AttentionInputs, capture_attention_inputs
from attention_variants.convert import ConvertSpec, convert
from attention_variants.summary import load_for_eval


def edit_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy a single-shard checkpoint, applying ``edit(weights)`` in place to its tensors."""
    dst.mkdir(parents=True)
    weights = load_file(src / "model.safetensors")
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def config_of(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


@torch.no_grad()
def logits(checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    return load_for_eval(checkpoint)(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def random_calibration(checkpoint: Path, seqs: int = 2, seq_len: int = 48, window: int | None = None) -> AttentionInputs:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager" if window else "sdpa"
    )
    ids = torch.randint(0, model.config.vocab_size, (seqs, seq_len), generator=torch.Generator().manual_seed(1))
    return capture_attention_inputs(model, ids, "random ids", window=window)


def convert_tiny(src: Path, out: Path, spec: ConvertSpec, calibrate: bool = False) -> Path:
    """Convert a tiny checkpoint (which has no tokenizer: calibration runs on random ids)."""
    calib = random_calibration(src, window=spec.sliding_window if spec.global_select == "calib" else None) if calibrate else None
    convert(src, spec, out, calib=calib)
    return out
