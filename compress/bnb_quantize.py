"""`compress quantize --nf4 | --int8-bnb`: bitsandbytes checkpoints, written through transformers.

bitsandbytes quantizes as transformers loads the model (``BitsAndBytesConfig``); the loaded model
is then saved (bitsandbytes' own tensors: packed 4-bit codes + absmax + quant map, or INT8 rows +
their scales) with the tokenizer and side files, into a temp dir renamed into place. transformers
reloads the result with ``from_pretrained(dir)`` (bitsandbytes installed), vLLM with
``--quantization bitsandbytes``. The whole model is held in memory once (bitsandbytes quantizes
at load); our compressed-tensors path streams layer by layer instead.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compress.quantize import open_source
from compress.quantize_options import QuantizeOptions
from foundation.atomic import atomic_output_dir, check_output_dir
from foundation.bnb_scheme import BnbKind, BnbScheme
from foundation.errors import KvslimError


@dataclass(frozen=True)
class BnbResult:
    out: Path
    scheme: BnbScheme
    quantized_linears: int
    bytes_before: int
    bytes_after: int
    seconds: float


def bnb_config(kind: BnbKind, compute_dtype: torch.dtype):
    """transformers' ``BitsAndBytesConfig`` for ``kind`` (NF4: 4-bit NF4 codes, no double quantization)."""
    from transformers import BitsAndBytesConfig

    if kind == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind, bnb_4bit_compute_dtype=compute_dtype)


def check_bnb_options(options: QuantizeOptions) -> None:
    """Refuse the flags bitsandbytes does not take (it quantizes round-to-nearest as it loads)."""
    flags = options.compressed_tensors_flags
    if flags:
        raise KvslimError(f"{flags[0]} does not apply to --{options.kind} (bitsandbytes quantizes every Linear "
                          "but lm_head, round-to-nearest, as transformers loads the model)")


def _safetensors_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def quantize_bnb(source: str | Path, out: str | Path, kind: BnbKind, dtype: torch.dtype | None = None,
                 force: bool = False) -> BnbResult:
    """Write ``source`` (an unquantized checkpoint) as a bitsandbytes ``kind`` checkpoint at ``out``.

    ``dtype``: unquantized tensors are stored in it and 4-bit Linears compute in it (default: the
    source's dtype)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise KvslimError("bitsandbytes is not installed (pip install bitsandbytes)") from None
    from transformers import AutoModelForCausalLM

    ckpt = open_source(source)
    check_output_dir(Path(out), force)
    start = time.perf_counter()
    dtype = dtype or ckpt.get("model.embed_tokens.weight").dtype
    model = AutoModelForCausalLM.from_pretrained(
        ckpt.path, quantization_config=bnb_config(kind, dtype), dtype=dtype, device_map="cpu")
    quantized = sum(1 for m in model.modules() if type(m).__module__.startswith("bitsandbytes"))
    with atomic_output_dir(out, force, checked=True) as tmp:
        model.save_pretrained(tmp)
        ckpt.copy_side_files(tmp, kv_plan=False)
        scheme = BnbScheme.of_model_config(json.loads((tmp / "config.json").read_text()))
        size = _safetensors_bytes(tmp)
    return BnbResult(Path(out), scheme, quantized, _safetensors_bytes(ckpt.path), size, time.perf_counter() - start)
