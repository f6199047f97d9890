"""Our quantized codes as llama.cpp's blocks of 32 (Q8_0, Q4_0, Q4_1), without re-quantizing.

A compressed-tensors INT weight is ``(q - zp) * scale`` with one scale per row (channel) or per
group of columns. Whenever every 32-column block lies inside one scale group (channel strategy,
or a group size that is a multiple of 32) the codes map onto GGML blocks exactly:

- ``Q8_0`` (``d``; 32 x int8; ``w = d * x``): ``x = q - zp`` (fits int8 for INT4 and for
  symmetric INT8), ``d = scale``.
- ``Q4_0`` (``d``; 32 nibbles; ``w = d * (u - 8)``): symmetric INT4, ``u = q + 8``, ``d = scale``.
- ``Q4_1`` (``d``, ``m``; 32 nibbles; ``w = d * u + m``): any INT4, ``u = q + 8``, ``d = scale``,
  ``m = -(zp + 8) * scale``.

``d`` and ``m`` are fp16 in GGML: a scale that fp16 does not hold exactly is rounded, which
``BlockEncoding`` reports (bf16 and fp16 scales within fp16's range are exact; ``m`` of Q4_1 is
a product that fp16 may round).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme

BLOCK = 32
# GGUF type name -> (bytes per block, what it can hold exactly)
GGUF_TYPES = ("q8_0", "q4_1", "q4_0")


@dataclass(frozen=True)
class BlockEncoding:
    """One tensor's GGML blocks (uint8 ``[rows, blocks * block_bytes]``) and how exact they are."""

    data: np.ndarray
    gguf_type: str
    max_scale_rel_change: float  # largest |fp16(d) - d| / |d| (0.0: exact)
    max_offset_rel_change: float  # Q4_1's m likewise (0.0 for the other types)


def exact_type_reason(scheme: QuantScheme, gguf_type: str) -> str | None:
    """Why ``gguf_type`` cannot hold ``scheme``'s codes exactly, or None when it can."""
    if scheme.type != "int":
        return f"{scheme.name} stores FP8 values, which no GGML integer block holds"
    if scheme.strategy == "group" and scheme.group_size % BLOCK:
        return f"group size {scheme.group_size} is not a multiple of GGML's {BLOCK}-column blocks"
    if gguf_type == "q8_0":
        if scheme.num_bits == 8 and not scheme.symmetric:
            return "asymmetric INT8 codes minus their zero point span 9 bits"
        return None
    if scheme.num_bits != 4:
        return f"{gguf_type} holds 4-bit codes, {scheme.name} has {scheme.num_bits}-bit weights"
    if gguf_type == "q4_0" and not scheme.symmetric:
        return "q4_0 has no zero point (asymmetric INT4 maps onto q4_1)"
    return None


def exact_type_for(scheme: QuantScheme) -> str | None:
    """The smallest GGUF type holding ``scheme``'s codes exactly (None: none does)."""
    for gguf_type in ("q4_0", "q4_1", "q8_0"):
        if exact_type_reason(scheme, gguf_type) is None:
            return gguf_type
    return None


def _per_block(t: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """A ``[rows, groups]`` scale or zero point repeated to one value per 32-column block."""
    t = t.reshape(rows, -1)
    return t.repeat_interleave(blocks // t.shape[1], dim=1)


def _fp16(t: torch.Tensor) -> tuple[np.ndarray, float]:
    """``t`` (fp32) as fp16 bytes-ready array, and the largest relative change the cast made."""
    if t.abs().max() > torch.finfo(torch.float16).max:
        raise KvslimError("a scale exceeds fp16's range (65504): GGML blocks cannot hold it")
    half = t.to(torch.float16)
    diff = (half.float() - t).abs() / t.abs().clamp_min(torch.finfo(torch.float32).tiny)
    return half.numpy(), float(diff.max()) if diff.numel() else 0.0


def _nibbles(u: torch.Tensor) -> np.ndarray:
    """``[rows, blocks, 32]`` values in [0, 15] -> ``[rows, blocks, 16]`` bytes (GGML order:
    element j in the low nibble of byte j, element j + 16 in its high nibble)."""
    u = u.to(torch.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).numpy()


def encode_blocks(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme, gguf_type: str
) -> BlockEncoding:
    """Encode one Linear's codes ``q`` (int8 ``[out, in]``) as ``gguf_type`` blocks, exactly.

    Raises ``KvslimError`` when ``gguf_type`` cannot hold them (see ``exact_type_reason``)."""
    reason = exact_type_reason(scheme, gguf_type)
    if reason is not None:
        raise KvslimError(reason)
    rows, cols = q.shape
    if cols % BLOCK:
        raise KvslimError(f"{cols} input columns are not a multiple of GGML's {BLOCK}-column blocks")
    blocks = cols // BLOCK
    d = _per_block(scale.float(), rows, blocks)
    zp = _per_block(zero_point.to(torch.int16), rows, blocks) if zero_point is not None else None
    codes = q.to(torch.int16).reshape(rows, blocks, BLOCK)
    d16, d_change = _fp16(d)
    m_change = 0.0
    if gguf_type == "q8_0":
        x = codes - zp.unsqueeze(-1) if zp is not None else codes
        parts = [d16.view(np.uint8).reshape(rows, blocks, 2), x.to(torch.int8).numpy().view(np.uint8)]
    else:
        u = codes + 8
        parts = [d16.view(np.uint8).reshape(rows, blocks, 2)]
        if gguf_type == "q4_1":
            offset = -((zp.float() if zp is not None else torch.zeros_like(d)) + 8) * d
            m16, m_change = _fp16(offset)
            parts.append(m16.view(np.uint8).reshape(rows, blocks, 2))
        parts.append(_nibbles(u))
    data = np.concatenate(parts, axis=-1).reshape(rows, -1)
    return BlockEncoding(np.ascontiguousarray(data), gguf_type, d_change, m_change)
