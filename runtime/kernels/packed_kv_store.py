"""Write new K/V into a packed low-bit layer (``runtime.cache.packed_layer``) with Triton.

The bookkeeping is the group's, done once per step before any layer writes (``ResidualSlots.apply``:
the slots the filled blocks held are recorded in the plan and given back, then the blocks left
open take slots); ``PackedLayerCache.apply_write`` keeps the order of the data, as for the torch
path. The data moves on the device:

- ``quantize_blocks_kernel``: every filled block, each row read from the new K/V (``plan.src``
  names the row) or from the residual slot the block held (``plan.full_slots``), cast to the
  residual dtype, and quantized as
  ``low_bit_kv._quantize``: keys per channel over the block's tokens, values per token and head;
  ``scale = fp16(max((hi - lo) / levels, 1e-6))``, ``minimum = fp16(lo)``, and codes
  ``round_half_even((x - minimum) / scale)`` clamped to ``[0, levels]`` from those fp16
  parameters (IEEE division, so the codes are the torch path's bit for bit), packed ``8 // bits``
  to a byte along head_dim, low bits first (keys at ``KEY_BITS``, values at ``VALUE_BITS``; 3-bit
  keys in a 2-bit plane and a 1-bit plane after it, ``low_bit_kv.pack``); with ``CLIP_STEPS`` a
  key channel's range is the one of least squared error among ``1 - i / 16`` of it about its
  centre, i <= CLIP_STEPS (``low_bit_kv.KEY_RANGE_SHRINKS``; the same fp32 candidates and errors,
  though a GPU may fuse the error's multiply-add and so break a near-tie between two ranges the
  other way), except in the blocks ``first`` marks (a sequence's first);
- ``residual_store_kernel``: the K/V rows ``[kvh, D]`` of each token left open into its block's
  residual slot ``slot_of[slot // block_size]`` at offset ``slot % block_size`` (in the residual
  dtype); the other tokens' slots are passed as -1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError
from runtime.cache.low_bit_kv import KEY_RANGE_SHRINKS, MIN_SCALE, PARAM_DTYPE, packed_dim
from runtime.cache.packed_layer import PackedLayerCache
from runtime.cache.write_plan import WritePlan
from runtime.kernels.kv_store import _round_half_even, _store_one

RESIDUAL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def residual_store_kernel(
    k_ptr, v_ptr, k_residual_ptr, v_residual_ptr, slot_of_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_rb, stride_rs, stride_rh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(T,)``: program t writes token t's K and V rows into its block's residual slot
    (none for a negative slot)."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    row = tl.load(slot_of_ptr + slot // block_size) * block_size + slot % block_size  # in the residual blocks
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_kv_heads
    ok = h_ok[:, None] & (offs_d[None, :] < head_dim)
    _store_one(k_ptr, k_residual_ptr, k_residual_ptr, token, row, block_size, stride_kt, stride_kh,
               stride_rb, stride_rs, stride_rh, 0, 0, offs_h, offs_d, ok, h_ok,
               False, False, False, 1.0, 1.0)
    _store_one(v_ptr, v_residual_ptr, v_residual_ptr, token, row, block_size, stride_vt, stride_vh,
               stride_rb, stride_rs, stride_rh, 0, 0, offs_h, offs_d, ok, h_ok,
               False, False, False, 1.0, 1.0)


@triton.jit
def _params(lo, hi, LEVELS: tl.constexpr, MIN_SCALE_: tl.constexpr):
    """fp16 scale and minimum of the range ``[lo, hi]``."""
    scale = tl.maximum(tl.math.div_rn(hi - lo, LEVELS * 1.0), MIN_SCALE_)
    return scale.to(tl.float16), lo.to(tl.float16)


@triton.jit
def _codes(x, scale, lo, LEVELS: tl.constexpr):
    """int32 codes of fp32 ``x`` under fp16 ``scale`` and ``lo`` (broadcast to x)."""
    c = _round_half_even(tl.math.div_rn(x - lo.to(tl.float32), scale.to(tl.float32)))
    return tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _squared_error(x, scale, lo, ok, LEVELS: tl.constexpr):
    """Per channel: the squared error of ``x [S, P]``'s codes under ``scale``, ``lo [P]``."""
    c = _codes(x, scale[None, :], lo[None, :], LEVELS).to(tl.float32)
    e = c * scale.to(tl.float32)[None, :] + lo.to(tl.float32)[None, :] - x
    return tl.sum(tl.where(ok, e * e, 0.0), axis=0)


@triton.jit
def _rows(x_ptr, residual_ptr, new_rows, old_rows, from_new, from_old, d):
    """fp32 tile of a filled block's rows at channels ``d``: its residual rows where ``from_old``,
    else the new rows (cast to the residual dtype, as stored) where ``from_new``, else 0."""
    new = tl.load(x_ptr + new_rows + d[None, :], mask=from_new, other=0.0).to(residual_ptr.dtype.element_ty)
    return tl.load(residual_ptr + old_rows + d[None, :], mask=from_old, other=new).to(tl.float32)


@triton.jit
def quantize_blocks_kernel(
    k_ptr, v_ptr, k_residual_ptr, v_residual_ptr, full_slot_ptr, blocks_ptr, src_ptr, first_ptr,
    k_codes_ptr, v_codes_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr,
    block_size, bytes_per_row, value_bytes_per_row,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_rb, stride_rs, stride_rh, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    stride_kpb, stride_kph, stride_vpb, stride_vps,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_VP: tl.constexpr, MIN_SCALE_: tl.constexpr, CLIP_STEPS: tl.constexpr,
):
    """Grid ``(num_blocks, kvh)``: program (i, h) quantizes head h of block ``blocks[i]`` (none where
    negative: a per-row plan's, ``WritePlan.per_row_plan``), whose row
    at offset s is new row ``src[i, s]`` or, where that is negative, its row in residual slot
    ``full_slot[i]`` (the slot the block held before this step's write; none where negative).
    Byte p of a packed row holds channels ``p * PER + j``, j < PER, so each pass j reads one
    ``[BLOCK_S, BLOCK_P]`` tile of channels and ORs its codes in at bit ``j * BITS`` (keys'
    ``BLOCK_P`` bytes a row, values' ``BLOCK_VP``, ``bytes_per_row`` and ``value_bytes_per_row``;
    3-bit keys: tiles of their 2-bit plane, ``bytes_per_row`` its bytes, the high plane after it)."""
    PER: tl.constexpr = 4 if KEY_BITS == 3 else 8 // KEY_BITS  # 3-bit: its 2-bit plane's channels a byte
    LEVELS: tl.constexpr = (1 << KEY_BITS) - 1
    VPER: tl.constexpr = 8 // VALUE_BITS
    VLEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
    i = tl.program_id(0)
    blk = tl.load(blocks_ptr + i).to(tl.int64)
    if blk < 0:  # a per-row plan's row that fills no block
        return
    head = tl.program_id(1)
    rslot = tl.load(full_slot_ptr + i)
    offs_s = tl.arange(0, BLOCK_S)
    offs_p = tl.arange(0, BLOCK_P)
    s_ok = offs_s < block_size
    p_ok = offs_p < bytes_per_row
    ok = s_ok[:, None] & p_ok[None, :]
    # int32 row offsets into this write's K/V (as in kv_store): int64 ones spill at block 64 x head_dim 128
    src = tl.load(src_ptr + i * block_size + offs_s, mask=s_ok, other=-1).to(tl.int32)
    from_new = ok & (src >= 0)[:, None]
    held = tl.zeros_like(src) + rslot >= 0  # a vector: the interpreter's bool & scalar bool is int32
    from_old = ok & ((src < 0) & held)[:, None]
    k_rows = (src * stride_kt + head * stride_kh)[:, None]
    v_rows = (src * stride_vt + head * stride_vh)[:, None]
    old_rows = rslot * stride_rb + offs_s[:, None] * stride_rs + head * stride_rh
    packed_at = blk * stride_cb + offs_s[:, None] * stride_cs + head * stride_ch + offs_p[None, :]

    # Keys: one range per channel over the block's tokens.
    packed = tl.zeros((BLOCK_S, BLOCK_P), dtype=tl.int32)
    high = tl.zeros((BLOCK_S, BLOCK_P), dtype=tl.int32)  # 3-bit: the high bits, at their plane's bit
    for j in tl.static_range(PER):
        d = offs_p * PER + j
        x = _rows(k_ptr, k_residual_ptr, k_rows, old_rows, from_new, from_old, d)
        lo = tl.min(tl.where(ok, x, float("inf")), axis=0)
        hi = tl.max(tl.where(ok, x, float("-inf")), axis=0)
        mid, half = (lo + hi) * 0.5, (hi - lo) * 0.5
        scale, lo = _params(lo, hi, LEVELS, MIN_SCALE_)
        if CLIP_STEPS > 0:
            # a sequence's first block keeps its full ranges: no candidate beats an error of -1
            err = tl.where(tl.load(first_ptr + i) == 0, _squared_error(x, scale, lo, ok, LEVELS), -1.0)
            for step in tl.static_range(1, CLIP_STEPS + 1):
                r = 1.0 - step / 16
                s_i, lo_i = _params(mid - half * r, mid + half * r, LEVELS, MIN_SCALE_)
                e_i = _squared_error(x, s_i, lo_i, ok, LEVELS)
                better = e_i < err
                scale, lo, err = tl.where(better, s_i, scale), tl.where(better, lo_i, lo), tl.where(better, e_i, err)
        tl.store(k_scale_ptr + blk * stride_kpb + head * stride_kph + d, scale, mask=p_ok)
        tl.store(k_min_ptr + blk * stride_kpb + head * stride_kph + d, lo, mask=p_ok)
        c = _codes(x, scale[None, :], lo[None, :], LEVELS)
        if KEY_BITS == 3:
            packed = packed | ((c & 3) << (j * 2))
            high = high | ((c >> 2) << (j + 4 * (offs_p % 2))[None, :])
        else:
            packed = packed | (c << (j * KEY_BITS))
    tl.store(k_codes_ptr + packed_at, packed.to(tl.uint8), mask=ok)
    if KEY_BITS == 3:  # the high plane after the low one: byte q holds channels 8q..8q+7, from tile bytes 2q, 2q+1
        high = tl.sum(tl.reshape(high, (BLOCK_S, BLOCK_P // 2, 2)), axis=2)
        offs_q = tl.arange(0, BLOCK_P // 2)
        high_at = blk * stride_cb + offs_s[:, None] * stride_cs + head * stride_ch + bytes_per_row + offs_q[None, :]
        tl.store(k_codes_ptr + high_at, high.to(tl.uint8), mask=s_ok[:, None] & (offs_q < bytes_per_row // 2)[None, :])

    # Values: one range per token over head_dim, in tiles of their own width.
    offs_vp = tl.arange(0, BLOCK_VP)
    v_ok = s_ok[:, None] & (offs_vp < value_bytes_per_row)[None, :]
    v_new, v_old = v_ok & (src >= 0)[:, None], v_ok & ((src < 0) & held)[:, None]
    lo = tl.full((BLOCK_S,), float("inf"), dtype=tl.float32)
    hi = tl.full((BLOCK_S,), float("-inf"), dtype=tl.float32)
    for j in tl.static_range(VPER):
        x = _rows(v_ptr, v_residual_ptr, v_rows, old_rows, v_new, v_old, offs_vp * VPER + j)
        lo = tl.minimum(lo, tl.min(tl.where(v_ok, x, float("inf")), axis=1))
        hi = tl.maximum(hi, tl.max(tl.where(v_ok, x, float("-inf")), axis=1))
    scale, lo = _params(lo, hi, VLEVELS, MIN_SCALE_)
    tl.store(v_scale_ptr + blk * stride_vpb + offs_s * stride_vps + head, scale, mask=s_ok)
    tl.store(v_min_ptr + blk * stride_vpb + offs_s * stride_vps + head, lo, mask=s_ok)
    packed = tl.zeros((BLOCK_S, BLOCK_VP), dtype=tl.int32)
    for j in tl.static_range(VPER):
        x = _rows(v_ptr, v_residual_ptr, v_rows, old_rows, v_new, v_old, offs_vp * VPER + j)
        packed = packed | (_codes(x, scale[:, None], lo[:, None], VLEVELS) << (j * VALUE_BITS))
    v_at = blk * stride_vcb + offs_s[:, None] * stride_vcs + head * stride_vch + offs_vp[None, :]
    tl.store(v_codes_ptr + v_at, packed.to(tl.uint8), mask=v_ok)


# --------------------------------------------------------------------------- checks
def check_packed_layer(cache: PackedLayerCache) -> None:
    """The tensor layout the packed kernels index: dtypes, shapes and unit innermost strides."""
    res, codes = cache.k_residual, cache.k_codes
    if res.dim() != 4 or cache.v_residual.shape != res.shape or res.dtype not in RESIDUAL_DTYPES:
        raise KvslimError(f"residual K/V must be equal [slots, block_size, kv_heads, head_dim] bf16/fp16/fp32, got "
                          f"{tuple(res.shape)} {res.dtype} and {tuple(cache.v_residual.shape)}")
    n, bs, kvh, d = codes.shape[0], res.shape[1], res.shape[2], res.shape[3]
    expected = {
        "k_codes": ((n, bs, kvh, packed_dim(d, cache.bits.keys)), torch.uint8),
        "v_codes": ((n, bs, kvh, packed_dim(d, cache.bits.values)), torch.uint8),
        "k_scale": ((n, kvh, d), PARAM_DTYPE), "k_min": ((n, kvh, d), PARAM_DTYPE),
        "v_scale": ((n, bs, kvh), PARAM_DTYPE), "v_min": ((n, bs, kvh), PARAM_DTYPE),
    }
    for name, (shape, dtype) in expected.items():
        t = getattr(cache, name)
        if tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1 or t.device != res.device:
            raise KvslimError(f"{name} must be {dtype} {list(shape)} with unit stride on {res.device}, "
                              f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    pairs = (("k_scale", "k_min"), ("v_scale", "v_min"), ("k_residual", "v_residual"))
    if res.stride(-1) != 1 or any(getattr(cache, a).stride() != getattr(cache, b).stride() for a, b in pairs):
        raise KvslimError("residual K and V (and each scale and its minimum) must have equal strides, unit on the "
                          "last dim")
    if cache.slot_of.dtype != torch.int64 or tuple(cache.slot_of.shape) != (n,):
        raise KvslimError(f"slot_of must be int64 [{n}], got {cache.slot_of.dtype} {tuple(cache.slot_of.shape)}")


def _check_store(k, v, cache: PackedLayerCache, slot_mapping) -> None:
    check_packed_layer(cache)
    expected = (k.shape[0], *cache.k_residual.shape[2:])
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise KvslimError(f"new k/v must be {list(expected)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (k.shape[0],):
        raise KvslimError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


# --------------------------------------------------------------------------- wrapper
def clip_steps(clipped: bool) -> int:
    """``quantize_blocks_kernel``'s CLIP_STEPS for keys ``clipped`` or not: clipped ranges tried beyond the full one."""
    return len(KEY_RANGE_SHRINKS) - 1 if clipped else 0


def key_tile_width(key_bits: int, head_dim: int) -> int:
    """Bytes of a packed key row that ``quantize_blocks_kernel``'s key tiles span (3-bit: its 2-bit plane)."""
    return packed_dim(head_dim, 2 if key_bits == 3 else key_bits)


def quantize_num_warps(block_size: int, head_dim: int) -> int:
    """Warps for one (block, head) of ``quantize_blocks_kernel``: about 16 elements per thread per
    channel tile (fewer warps spill registers at block 64, head_dim 128)."""
    return min(16, max(4, triton.next_power_of_2(block_size) * triton.next_power_of_2(head_dim) // 512))


def store_packed_kv(k: torch.Tensor, v: torch.Tensor, cache: PackedLayerCache, slot_mapping: torch.Tensor, *,
                    plan: WritePlan | None = None, validate: bool = True) -> None:
    """Write ``k``, ``v`` ``[T, KVH, D]`` at ``slot_mapping`` and quantize the blocks they fill
    (``PackedLayerCache.write`` on the device). ``validate=False``: the caller checked the layer
    once (``check_packed_layer``) and the step's inputs where it built them."""
    if validate:
        _check_store(k, v, cache, slot_mapping)
    k, v = k.contiguous(), v.contiguous()
    T, kvh, d = k.shape
    res, codes, vc = cache.k_residual, cache.k_codes, cache.v_codes
    bs = res.shape[1]
    key_tile_bytes = key_tile_width(cache.bits.keys, d)

    def quantize(plan: WritePlan) -> None:
        ks, vs = cache.k_scale, cache.v_scale
        quantize_blocks_kernel[(plan.full.numel(), kvh)](
            # the write's new rows
            k_ptr=k, v_ptr=v, stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0),
            stride_vh=v.stride(1),
            # the blocks it fills, where each of their rows comes from, and the rows held open so far
            blocks_ptr=plan.full, src_ptr=plan.src.contiguous(), first_ptr=plan.first, block_size=bs,
            k_residual_ptr=res, v_residual_ptr=cache.v_residual, full_slot_ptr=plan.full_slots,
            stride_rb=res.stride(0), stride_rs=res.stride(1), stride_rh=res.stride(2),
            # the packed codes and their parameters
            k_codes_ptr=codes, v_codes_ptr=vc, bytes_per_row=key_tile_bytes, value_bytes_per_row=vc.shape[-1],
            stride_cb=codes.stride(0), stride_cs=codes.stride(1), stride_ch=codes.stride(2),
            stride_vcb=vc.stride(0), stride_vcs=vc.stride(1), stride_vch=vc.stride(2),
            k_scale_ptr=ks, k_min_ptr=cache.k_min, stride_kpb=ks.stride(0), stride_kph=ks.stride(1),
            v_scale_ptr=vs, v_min_ptr=cache.v_min, stride_vpb=vs.stride(0), stride_vps=vs.stride(1),
            # bits and tile shapes
            KEY_BITS=cache.bits.keys, VALUE_BITS=cache.bits.values, BLOCK_S=triton.next_power_of_2(bs),
            BLOCK_P=triton.next_power_of_2(key_tile_bytes), BLOCK_VP=triton.next_power_of_2(vc.shape[-1]),
            MIN_SCALE_=MIN_SCALE, CLIP_STEPS=clip_steps(cache.keys_clipped), num_warps=quantize_num_warps(bs, d),
        )

    def store(stays: torch.Tensor) -> None:
        residual_store_kernel[(T,)](
            k, v, res, cache.v_residual, cache.slot_of, torch.where(stays, slot_mapping, -1), kvh, d, bs,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), res.stride(0), res.stride(1), res.stride(2),
            BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
        )

    cache.apply_write(slot_mapping, quantize, store, plan)


# --------------------------------------------------------------------------- reference (plain torch)
def reference_store_packed_kv(k: torch.Tensor, v: torch.Tensor, cache: PackedLayerCache, slot_mapping: torch.Tensor, *,
                              plan: WritePlan | None = None, validate: bool = True) -> None:
    """Plain-torch oracle (and CPU path) for ``store_packed_kv``: ``PackedLayerCache.write``."""
    if validate:
        _check_store(k, v, cache, slot_mapping)
    cache.write(k, v, slot_mapping, plan)
