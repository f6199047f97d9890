"""Quantize / dequantize KV vectors: FP8 E4M3 and INT8, symmetric, absmax scales.

Two scale granularities, both fp32:
- per token and head (dynamic): ``scale[..., h] = absmax(x[..., h, :]) / qmax``, computed on write;
- per layer (static): one scalar from the checkpoint's ``self_attn.k_scale`` / ``v_scale``.
``dequantize(q, scale) = q.float() * scale``. Pure functions; the cache calls them on write/read.
"""
from __future__ import annotations

import torch

from foundation.errors import KvslimError

QUANT_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
_MIN_SCALE = 1e-8  # an all-zero head gets a tiny scale, never a division by zero


def _cast(x: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    qmax = QMAX[qdtype]
    x = x.clamp(-qmax, qmax)
    if qdtype == torch.int8:
        x = x.round()
    return x.to(qdtype)


def quantize_per_token_head(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H, D]`` -> (``q [..., H, D]`` in ``qdtype``, ``scale [..., H]`` fp32)."""
    if qdtype not in QMAX:
        raise KvslimError(f"KV quantization supports {sorted(str(d) for d in QMAX)}, not {qdtype}")
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / QMAX[qdtype]).clamp_min(_MIN_SCALE)
    return _cast(xf / scale.unsqueeze(-1), qdtype), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """Quantize with a fixed (per-layer scalar) scale; values beyond the range saturate."""
    if qdtype not in QMAX:
        raise KvslimError(f"KV quantization supports {sorted(str(d) for d in QMAX)}, not {qdtype}")
    return _cast(x.float() / scale.float(), qdtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [..., H, D]`` and ``scale [..., H]`` (per token/head) or a scalar -> ``dtype``."""
    s = scale.float()
    if s.dim() > 0:
        s = s.unsqueeze(-1)
    return (q.float() * s).to(dtype)
