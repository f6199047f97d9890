"""Pure tensor ops for weight quantization, bit-compatible with compressed-tensors 0.20.

Conventions (checked against ``compressed_tensors`` itself, see tests/compress/test_primitives.py):

- Scales (``calculate_qparams``, min-max): the range always includes 0. Symmetric:
  ``scale = max(|min|, |max|) / ((q_max - q_min) / 2)`` (INT4: /7.5, INT8: /127.5, FP8: /448),
  zero point 0. Asymmetric: ``scale = (max - min) / (q_max - q_min)``,
  ``zp = round(clamp(q_min - min / scale, q_min, q_max))`` stored as int8. A zero scale becomes
  the dtype's eps. Scales have the weight's dtype.
- Quantize: ``clamp(x / scale + zp, q_min, q_max)`` then ``round`` (INT, half to even) or a cast
  to ``float8_e4m3fn`` (FP8). Dequantize: ``(q.to(scale.dtype) - zp) * scale``.
- Shapes: channel strategy ``scale [out, 1]``; group strategy ``scale [out, in / group]``.
- Packing (``pack-quantized``): signed values are offset by ``2 ** (bits - 1)`` (+8 for INT4,
  +128 for INT8) to unsigned, then ``32 / bits`` consecutive values go into one int32, the first
  in the lowest bits. Weights pack along the input dimension (``[out, in] -> [out, in * bits /
  32]``); asymmetric zero points pack along the output dimension (``[out, g] -> [ceil(out * bits
  / 32), g]``). A trailing partial word is zero-padded.
- On-disk tensors of one Linear (names relative to the module): ``weight`` (FP8) or
  ``weight_packed`` (int32) + ``weight_shape`` (int64 ``[out, in]``); ``weight_scale``;
  ``weight_zero_point`` (asymmetric packed formats only); ``weight_g_idx`` (act-order only,
  int32 ``[in]``: the group of each input column).
"""
from __future__ import annotations

import math
import sys

import torch

from foundation.schemes import QuantScheme

# The on-disk tensors of one quantized Linear, relative to the module (the docstring above).
LINEAR_TENSORS = ("weight", "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")

FP8_DTYPE = torch.float8_e4m3fn
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _scale_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    # compressed-tensors' initialize_qparams: scales take the observed dtype (fp16 otherwise).
    return weight_dtype if weight_dtype in _FLOAT_DTYPES else torch.float16


def _grouped(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``[out, in] -> [out, n_groups, group]`` (group strategy) or ``[out, 1, in]`` (channel)."""
    out, cols = x.shape
    if scheme.strategy == "channel":
        return x.reshape(out, 1, cols)
    g = int(scheme.group_size)
    if cols % g:
        raise ValueError(f"group size {g} does not divide {cols} columns")
    return x.reshape(out, cols // g, g)


def compute_qparams(
    weight: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale and zero point of a ``[out, in]`` weight.

    Returns ``scale`` (weight dtype; ``[out, 1]`` channel, ``[out, in/group]`` group) and
    ``zero_point`` (int8, same shape) for asymmetric schemes, else ``None``.
    """
    grouped = _grouped(weight, scheme)
    return qparams_from_range(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme)


def qparams_from_range(
    min_vals: torch.Tensor, max_vals: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale / zero point from observed ranges (any shape; GPTQ calls this per group)."""
    dtype = min_vals.dtype
    min_vals = torch.minimum(min_vals, torch.zeros((), dtype=dtype))
    max_vals = torch.maximum(max_vals, torch.zeros((), dtype=dtype))
    q_min = torch.tensor(scheme.q_min)
    q_max = torch.tensor(scheme.q_max)
    bit_range = (q_max - q_min).to(dtype)
    zero_point = None
    if scheme.symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals.abs()) / (bit_range / 2)
    else:
        scale = (max_vals - min_vals) / bit_range
        zp = torch.clamp(q_min.to(dtype) - min_vals / scale, q_min, q_max)
    eps = torch.finfo(scale.dtype).eps
    scale = torch.where(scale == 0, torch.tensor(eps, dtype=scale.dtype), scale)
    if not scheme.symmetric:
        # compressed-tensors computes zp before the eps fix-up (nan for an all-zero group,
        # which clamp keeps as nan and the int8 cast turns into 0).
        zero_point = torch.round(torch.clamp(torch.nan_to_num(zp, nan=0.0), -128, 127)).to(torch.int8)
    scale = scale.to(_scale_dtype(dtype))
    return scale, zero_point


def quantize(
    weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Quantize ``[out, in]`` -> int8 values in ``[q_min, q_max]`` or float8_e4m3fn."""
    out, cols = weight.shape
    grouped = _grouped(weight, scheme)
    scaled = grouped / scale.to(weight.dtype).unsqueeze(-1)
    if zero_point is not None:
        scaled = scaled + zero_point.to(weight.dtype).unsqueeze(-1)
    clamped = torch.clamp(scaled, scheme.q_min, scheme.q_max)
    if scheme.type == "float":
        q = clamped.to(FP8_DTYPE)
    else:
        q = torch.round(clamped).to(torch.int8)
    return q.reshape(out, cols)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: QuantScheme,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``(q - zp) * scale`` in the scale's dtype.

    ``g_idx`` (act-order): the group of each input column; scales are gathered per column.
    """
    out, cols = q.shape
    dtype = scale.dtype
    if g_idx is not None:
        col_scale = scale[:, g_idx.long()]
        x = q.to(dtype)
        if zero_point is not None:
            x = x - zero_point[:, g_idx.long()].to(dtype)
        return x * col_scale
    grouped = _grouped(q, scheme).to(dtype)
    if zero_point is not None:
        grouped = grouped - zero_point.to(dtype).unsqueeze(-1)
    return (grouped * scale.unsqueeze(-1)).reshape(out, cols)


# --- int32 packing ----------------------------------------------------------------------------
def pack_int32(values: torch.Tensor, num_bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed 4- or 8-bit integers (2-D int8 tensor) into int32 words along ``packed_dim``.

    Each value is offset by ``2 ** (num_bits - 1)``; value ``i`` of a row lands in word
    ``i // (32 / num_bits)`` at bit ``(i % (32 / num_bits)) * num_bits`` (lowest first).
    Implemented on bytes (little-endian words, as on every host torch ships for).
    """
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError("pack_int32 takes a 2-D int8 tensor")
    if num_bits not in (4, 8):
        raise ValueError(f"pack_int32 supports 4 or 8 bits, got {num_bits}")
    _check_little_endian()
    v = values.t() if packed_dim == 0 else values
    rows, cols = v.shape
    per_word = 32 // num_bits
    words = math.ceil(cols / per_word)
    u = (v.to(torch.int16) + (1 << (num_bits - 1))).to(torch.uint8)
    u = torch.nn.functional.pad(u, (0, words * per_word - cols))
    if num_bits == 4:
        pairs = u.reshape(rows, words * 4, 2)
        u = pairs[..., 0] | (pairs[..., 1] << 4)
    # Flatten first: a [1, n] tensor can be 'contiguous' with stride (1, 1), which view() rejects.
    packed = u.contiguous().reshape(-1).view(torch.int32).reshape(rows, words)
    return (packed.t() if packed_dim == 0 else packed).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, packed_dim: int = 1) -> torch.Tensor:
    """Inverse of ``pack_int32``: ``size`` signed values (int8) along ``packed_dim``."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError("unpack_int32 takes a 2-D int32 tensor")
    if num_bits not in (4, 8):
        raise ValueError(f"unpack_int32 supports 4 or 8 bits, got {num_bits}")
    _check_little_endian()
    p = packed.t() if packed_dim == 0 else packed
    rows, words = p.shape
    per_word = 32 // num_bits
    if words * per_word < size or (words - 1) * per_word >= size:
        raise ValueError(f"{words} packed words cannot hold exactly {size} {num_bits}-bit values")
    u = p.contiguous().view(torch.uint8).reshape(rows, words * 4)
    if num_bits == 4:
        u = torch.stack((u & 0xF, u >> 4), dim=-1).reshape(rows, words * 8)
    v = (u[:, :size].to(torch.int16) - (1 << (num_bits - 1))).to(torch.int8)
    return (v.t() if packed_dim == 0 else v).contiguous()


def _check_little_endian() -> None:
    if sys.byteorder != "little":
        raise RuntimeError("int32 packing assumes a little-endian host")


# --- one Linear's on-disk tensors -------------------------------------------------------------
def encode_linear(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scheme: QuantScheme,
    g_idx: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors stores for one Linear, given quantized values.

    Keys are relative to the module (``weight``/``weight_packed``, ``weight_scale``, ...).
    """
    out, cols = q.shape
    tensors: dict[str, torch.Tensor] = {}
    if scheme.is_packed:
        tensors["weight_packed"] = pack_int32(q, scheme.num_bits, packed_dim=1)
        tensors["weight_shape"] = torch.tensor([out, cols], dtype=torch.int64)
        if not scheme.symmetric:
            if zero_point is None:
                raise ValueError("asymmetric scheme needs a zero point")
            tensors["weight_zero_point"] = pack_int32(zero_point, scheme.num_bits, packed_dim=0)
    else:
        tensors["weight"] = q
    tensors["weight_scale"] = scale
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


def decode_linear(
    tensors: dict[str, torch.Tensor], scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Unpack on-disk tensors to ``(q, scale, zero_point, g_idx)``; q is int8 or float8."""
    scale = tensors["weight_scale"]
    g_idx = tensors.get("weight_g_idx")
    if not scheme.is_packed:
        return tensors["weight"], scale, None, g_idx
    out, cols = (int(v) for v in tensors["weight_shape"].tolist())
    q = unpack_int32(tensors["weight_packed"], scheme.num_bits, cols, packed_dim=1)
    zero_point = None
    if not scheme.symmetric:
        zero_point = unpack_int32(tensors["weight_zero_point"], scheme.num_bits, out, packed_dim=0)
    return q, scale, zero_point, g_idx


def dequantize_linear(tensors: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """The float weight ``[out, in]`` (scale dtype) a Linear's on-disk tensors stand for.

    Bit-identical to compressed-tensors' decompression of the same tensors.
    """
    q, scale, zero_point, g_idx = decode_linear(tensors, scheme)
    return dequantize(q, scale, zero_point, scheme, g_idx)


def quantize_dequantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest fake quantization (min-max qparams), for error measurements."""
    scale, zp = compute_qparams(weight, scheme)
    return dequantize(quantize(weight, scale, zp, scheme), scale, zp, scheme)
