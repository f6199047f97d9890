"""K and V at 4, 3 or 2 bits, KIVI-style: asymmetric codes, keys per channel, values per token.

``int4`` and ``int2`` store keys and values at the same width; ``k4v2`` and ``k3v2`` store keys at
4 or 3 bits and values at 2 (KIVI's finding: keys carry the outlier channels that retrieval reads,
values average their error out over the attended tokens). Each rule below applies to the part at
its width.

Keys have outlier *channels* (a few head_dim coordinates large for every token), so a key block
is quantized per channel over the block's tokens: ``scale, minimum [blocks, kv_heads, head_dim]``.
Values have no such structure and are quantized per token and head: ``scale, minimum [..., kv_heads]``.
A code ``c`` in ``[0, 2**bits - 1]`` stands for ``minimum + c * scale``; scales and minima are
fp16. Codes are packed along head_dim, ``8 // bits`` to a byte (low bits first); 3-bit codes in two
planes, their low 2 bits as 2-bit codes (``D / 4`` bytes) then their high bit as 1-bit codes
(``D / 8`` bytes), so every byte holds whole codes of one width.

At 2 bits a key channel's range is also *clipped*: one large key in a channel's 64 tokens would
stretch its four levels over the rest. Ranges ``KEY_RANGE_SHRINKS`` of ``[min, max]`` about its centre
are tried, and the one whose codes reconstruct the channel with least squared error is stored
(the full range is a candidate, so no block reconstructs worse than unclipped). A sequence's first
block keeps its full ranges: its attention sinks' keys are the outliers clipping would cut, and
it is read quantized in windowed groups and on prefix-cache hits.

At 2 bits keys are stored *before* RoPE and rotated after dequantization on every read (KVQuant):
RoPE turns each channel pair at a per-position angle, which smears an outlier channel over its
pair across a block's tokens; before RoPE a channel keeps one range. At 2 bits values arrive in a
rotated basis (``kv_rotation``: the attention backends rotate them in and the output back); at 4
bits keys do, after RoPE, and the queries with them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from foundation.kv_dtype_mix import SEPARATOR, split_variants


@dataclass(frozen=True)
class PackedBits:
    """Code widths of a packed KV dtype: keys' and values'."""

    keys: int
    values: int

    @property
    def widths(self) -> frozenset[int]:
        return frozenset((self.keys, self.values))


LOW_BIT_KV: dict[str, PackedBits] = {  # KV dtype name -> its code widths
    "int4": PackedBits(4, 4), "int2": PackedBits(2, 2), "k4v2": PackedBits(4, 2), "k3v2": PackedBits(3, 2),
}
PARAM_DTYPE = torch.float16
PARAM_BYTES = 2
MIN_SCALE = 1e-6  # an all-equal channel or token gets a tiny scale, never a division by zero
# Bit widths whose keys are stored before RoPE. Measured on the dev slice (wikipedia:calib, context
# 2,048): int2 +35% -> +22% perplexity; int4 +0.21% -> +0.17%, less than a rotation per read costs;
# k3v2, served: +1.72% -> +1.20% (its 3-bit keys clipped as well +1.28%, clipped alone +1.30%).
KEYS_BEFORE_ROPE_BITS = frozenset({2, 3})
# Bit widths whose sequences keep their first block (the attention sinks) exact while they run, in
# full-attention groups, where either part is stored at one of them (``packed_layer``): a bf16
# block per sequence and layer, counted in bytes per token. Measured served on the dev slice
# (wikipedia:calib [32768, 36864), context 2,048): int2 +21.9% -> +11.7%; k4v2 +2.19% -> +0.88%;
# k3v2 +2.95% -> +1.20%.
EXACT_FIRST_BLOCK_BITS = frozenset({2})
# Fractions of a key channel's range tried about its centre (multiples of 1/16: the kernel computes
# the same fp32 candidates), and the widths that clip. On the dev slice, simulated
# (benchmarks/kv_quant_options.py): int2 +12.45% -> +4.18%, values clipped as well +10.05%;
# served: +11.7% -> +3.85%. Ranges down to 3/4, not 1/2: a narrower range cuts the large key a
# retrieved fact needs (calibration retrieval, benchmarks/kv_retrieval_logprob.py, needle_calib +
# multikey_calib at depths 0-50%: mean key log-probability -1.279 -> -1.012, exact -0.201; dev
# slice served +3.05% -> +3.46%, simulated 15.054 -> 15.007). Keys rotated after RoPE instead of
# stored before it retrieve worse (-1.493, or -1.126 down to 3/4); rotated and unclipped best
# (-0.870), at 4.5% higher dev perplexity (simulated).
KEY_RANGE_SHRINKS = tuple(1 - i / 16 for i in range(5))
CLIPPED_KEY_BITS = frozenset({2})
# Bit widths whose values are kept in a rotated basis (``kv_rotation``). On the dev slice,
# simulated (keys clipped): int2 +4.18% -> +3.61%; served: +3.85% -> +3.05%.
VALUES_ROTATED_BITS = frozenset({2})
# Bit widths whose keys (after RoPE) are kept in a rotated basis, queries rotated alike
# (``kv_rotation``); disjoint from KEYS_BEFORE_ROPE_BITS, which rotate keys by RoPE on read. int4
# loses calibration retrieval through its keys, not its values (a needle's teacher-forced
# log-probability, simulated by benchmarks/kv_retrieval_logprob.py, needle_calib + multikey_calib at
# depths 0-50%, 4 prompts each: exact -0.201, int4 -0.297, keys alone -0.278, values alone -0.211);
# rotated keys -0.210 (32-token key blocks -0.282, first block exact -0.227). Chosen as the best
# calibration retrieval within int4's +1% perplexity target: dev slice, served, +0.16% -> +0.56%.
KEYS_ROTATED_BITS = frozenset({4})


def default_block_size(kv_dtype: str) -> int:
    """Tokens per block: 64 where any group stores packed KV (a key block's per-channel
    parameters cost 4 bytes per channel and head, 4 bytes per token at head_dim 64 over 64 tokens;
    16 at block 16), else 16. ``kv_dtype`` may name a mix (``int8/int2``) and variants
    (``int4:exact-first-block``)."""
    return 64 if any(part in LOW_BIT_KV for part in split_variants(kv_dtype)[0].split(SEPARATOR)) else 16


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes of one packed head_dim row."""
    return head_dim * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) -> ``[..., D * bits / 8]`` uint8."""
    if bits == 3:
        return torch.cat([pack(codes & 3, 2), pack(codes >> 2, 1)], dim=-1)
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.uint8)
    out = c[..., 0]
    for j in range(1, per):
        out = out | (c[..., j] << (bits * j))
    return out


# A byte's codes spread one to a byte of a wider integer, which read as bytes (little-endian) are
# the codes in order: one elementwise op and a view, where a stack of the parts would be a copy
# (a ``cat`` that inductor cannot fuse into the read).
_WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D * bits / 8]`` uint8 -> uint8 codes ``[..., D]``."""
    if bits == 3:
        low = packed.shape[-1] * 2 // 3  # the 2-bit plane's bytes
        return unpack(packed[..., :low], 2) | (unpack(packed[..., low:], 1) << 2)
    per, mask = 8 // bits, (1 << bits) - 1
    if sys.byteorder != "little":
        return torch.stack([(packed >> (bits * j)) & mask for j in range(per)], dim=-1).flatten(-2)
    wide = packed.to(_WIDE[per])
    spread = wide & mask
    for j in range(1, per):
        spread = spread | ((wide << (8 * j - bits * j)) & (mask << (8 * j)))
    return spread.view(torch.uint8)


def _params(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scale and minimum of the range ``[lo, hi]``."""
    return ((hi - lo) / levels).clamp_min(MIN_SCALE).to(PARAM_DTYPE), lo.to(PARAM_DTYPE)


def _codes(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, levels: int) -> torch.Tensor:
    # Codes from the fp16 parameters actually stored, so that dequantization inverts them.
    return torch.round((x - lo.float()) / scale.float()).clamp_(0, levels)


def _squared_error(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dim: int, levels: int) -> torch.Tensor:
    return (_codes(x, scale, lo, levels) * scale.float() + lo.float() - x).square().sum(dim, keepdim=True)


def _clipped_params(x: torch.Tensor, dim: int, levels: int, lo: torch.Tensor,
                    hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameters of least squared error over the ranges ``KEY_RANGE_SHRINKS`` of ``[lo, hi]``
    (the first one found on a tie: the full range before any clipped one)."""
    scale, low = _params(lo, hi, levels)
    err = _squared_error(x, scale, low, dim, levels)
    mid, half = (lo + hi) * 0.5, (hi - lo) * 0.5
    for r in KEY_RANGE_SHRINKS[1:]:
        s, m = _params(mid - half * r, mid + half * r, levels)
        e = _squared_error(x, s, m, dim, levels)
        better = e < err
        scale, low, err = torch.where(better, s, scale), torch.where(better, m, low), torch.where(better, e, err)
    return scale, low


def _quantize(x: torch.Tensor, dim: int, bits: int,
              clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``clip``: where (broadcast over ``x``'s parameters) the range is clipped; None: nowhere."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    if clip is not None and bool(clip.any()):
        clipped_scale, clipped_lo = _clipped_params(x, dim, levels, lo, hi)
        full_scale, full_lo = _params(lo, hi, levels)
        scale, lo = torch.where(clip, clipped_scale, full_scale), torch.where(clip, clipped_lo, full_lo)
    else:
        scale, lo = _params(lo, hi, levels)
    codes = _codes(x, scale, lo, levels).to(torch.uint8)
    return pack(codes, bits), scale.squeeze(dim), lo.squeeze(dim)


def quantize_key_blocks(x: torch.Tensor, bits: int, first: torch.Tensor | None = None,
                        clipped: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full key blocks ``[n, block_size, kvh, D]`` -> (codes ``[n, block_size, kvh, D*bits/8]``,
    scale, minimum ``[n, kvh, D]``), per channel over each block's tokens; ranges clipped where
    ``clipped`` (default: at ``CLIPPED_KEY_BITS``) except in the blocks ``first [n]`` marks (a
    sequence's first block: its attention sinks' keys are the outliers clipping would cut)."""
    if not (bits in CLIPPED_KEY_BITS if clipped is None else clipped):
        return _quantize(x.float(), 1, bits)
    clip = torch.ones(x.shape[0], dtype=torch.bool, device=x.device) if first is None else ~first.to(x.device)
    return _quantize(x.float(), 1, bits, clip.view(-1, 1, 1, 1))


def quantize_value_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., kvh, D]`` -> (codes ``[..., kvh, D*bits/8]``, scale, minimum ``[..., kvh]``)."""
    return _quantize(x.float(), -1, bits)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[..., block_size, kvh, Dp]`` with ``[..., kvh, D]`` parameters -> ``[..., block_size, kvh, D]``."""
    c = unpack(codes, bits).float()  # fp32 math, one rounding to dtype (as the kernel)
    return (c * scale.unsqueeze(-3).float() + lo.unsqueeze(-3).float()).to(dtype)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Codes ``[..., kvh, Dp]`` with ``[..., kvh]`` parameters -> ``[..., kvh, D]``."""
    c = unpack(codes, bits).float()
    return (c * scale.unsqueeze(-1).float() + lo.unsqueeze(-1).float()).to(dtype)


def bytes_per_token_head(head_dim: int, bits: PackedBits, block_size: int) -> float:
    """Stored bytes per token and KV head, K and V, codes and parameters (no residual)."""
    codes = packed_dim(head_dim, bits.keys) + packed_dim(head_dim, bits.values)
    key_params = 2 * PARAM_BYTES * head_dim / block_size  # per channel, shared by the block's tokens
    value_params = 2 * PARAM_BYTES
    return codes + key_params + value_params
