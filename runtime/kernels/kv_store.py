"""Write new K/V into the paged cache, quantizing on write.

Cache layout (one cache group): ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in bf16/fp16/fp32, float8_e4m3fn or int8. Quantized caches carry scales, either
``[num_blocks, block_size, num_kv_heads]`` fp32 (per token and head, computed here on write) or
a one-element fp32 tensor (a static per-layer scale from the checkpoint's ``k_scale``/``v_scale``).

New tokens ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` go to ``slot_mapping`` int64 ``[T]``
(``block * block_size + offset``); a negative slot means "skip" (padding).

Quantization is ``runtime.cache.kv_quant``'s (the CPU cache's), bit for bit: with ``QMAX`` = 448
(fp8) or 127 (int8), a per-token scale is ``max(amax over head_dim / QMAX, 1e-8)``; the stored
value is ``x / scale`` clamped to ``[-QMAX, QMAX]`` and rounded to nearest even (int8) or cast
with round-to-nearest-even (fp8). Dequantized value: ``stored * scale``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError
from runtime.cache.kv_quant import QMAX
from runtime.cache.paged_rows import store_rows

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8)
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
MIN_SCALE = 1e-8  # kv_quant's floor for an all-zero head


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _store_one(
    x_ptr, cache_ptr, scale_ptr, token, slot, block_size,
    stride_xt, stride_xh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
    offs_h, offs_d, ok, h_ok,
    QUANT: tl.constexpr, SCALE_PER_TOKEN: tl.constexpr, IS_INT8: tl.constexpr, QMAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr,
):
    x = tl.load(x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=ok, other=0.0)
    blk = (slot // block_size).to(tl.int64)
    off = slot % block_size
    dst = cache_ptr + blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    if QUANT:
        x = x.to(tl.float32)
        if SCALE_PER_TOKEN:
            scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX_), MIN_SCALE_)
            tl.store(scale_ptr + blk * stride_sb + off * stride_ss + offs_h, scale, mask=h_ok)
            y = tl.math.div_rn(x, scale[:, None])
        else:
            y = tl.math.div_rn(x, tl.load(scale_ptr))
        y = tl.minimum(tl.maximum(y, -QMAX_), QMAX_)
        if IS_INT8:
            y = _round_half_even(y)
        tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
    QUANT: tl.constexpr, SCALE_PER_TOKEN: tl.constexpr, IS_INT8: tl.constexpr, QMAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(T,)``: program t writes token t's ``[num_kv_heads, head_dim]`` K and V rows."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_kv_heads
    ok = h_ok[:, None] & (offs_d[None, :] < head_dim)
    _store_one(k_ptr, k_cache_ptr, k_scale_ptr, token, slot, block_size, stride_kt, stride_kh,
               stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, offs_h, offs_d, ok, h_ok,
               QUANT, SCALE_PER_TOKEN, IS_INT8, QMAX_, MIN_SCALE_)
    _store_one(v_ptr, v_cache_ptr, v_scale_ptr, token, slot, block_size, stride_vt, stride_vh,
               stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, offs_h, offs_d, ok, h_ok,
               QUANT, SCALE_PER_TOKEN, IS_INT8, QMAX_, MIN_SCALE_)


# --------------------------------------------------------------------------- checks
def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Validate scales against a cache's dtype; return True when they are per token and head."""
    quantized = k_cache.dtype in QUANTIZED_KV_DTYPES
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise KvslimError(f"a {k_cache.dtype} KV cache takes no scales")
        return False
    if k_scale is None or v_scale is None:
        raise KvslimError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale")
    per_token_shape = tuple(k_cache.shape[:3])
    kinds = set()
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or s.device != k_cache.device:
            raise KvslimError(f"{name} must be fp32 on {k_cache.device}, got {s.dtype} on {s.device}")
        if tuple(s.shape) == per_token_shape and s.is_contiguous():
            kinds.add(True)
        elif s.numel() == 1:
            kinds.add(False)
        else:
            raise KvslimError(f"{name} shape {tuple(s.shape)} is neither contiguous {list(per_token_shape)} nor a scalar")
    if len(kinds) != 1:
        raise KvslimError("k_scale and v_scale must both be per-token or both scalars")
    return kinds.pop()


def scales_per_token(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether scales that ``check_kv_scales`` accepted are per token and head (else none or scalars)."""
    return k_scale is not None and tuple(k_scale.shape) == tuple(k_cache.shape[:3])


def check_layer_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> None:
    """One layer's paged cache and scales, as the store and attention kernels index them: checked
    once where the cache is built (``validate=False`` then skips it per call)."""
    check_kv_cache(k_cache, v_cache)
    check_kv_scales(k_cache, k_scale, v_scale)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise KvslimError(f"k_cache/v_cache must be equal [blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.dtype not in KV_DTYPES:
        raise KvslimError(f"KV cache dtype {k_cache.dtype} is not bf16/fp16/fp32/float8_e4m3fn/int8")
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise KvslimError("k_cache/v_cache must have unit stride on head_dim and equal strides")


def _check_store(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_kv_cache(k_cache, v_cache)
    expected = (k.shape[0], *k_cache.shape[2:])
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise KvslimError(f"new k/v must be {list(expected)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (k.shape[0],):
        raise KvslimError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


# --------------------------------------------------------------------------- wrapper
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> None:
    """Write ``k``, ``v`` ``[T, KVH, D]`` into the cache at ``slot_mapping`` (in place).
    ``validate=False``: the caller checked the cache once (``check_layer_cache``) and the step's
    inputs where it built them."""
    if validate:
        _check_store(k, v, k_cache, v_cache, slot_mapping)
        check_kv_scales(k_cache, k_scale, v_scale)
    per_token = scales_per_token(k_cache, k_scale)
    k, v = k.contiguous(), v.contiguous()
    T, kvh, d = k.shape
    quant = k_cache.dtype in QUANTIZED_KV_DTYPES
    scale_k = k_scale if quant else k_cache
    scale_v = v_scale if quant else k_cache
    stride_sb, stride_ss = (scale_k.stride(0), scale_k.stride(1)) if per_token else (0, 0)
    if T == 0:
        return
    store_kv_kernel[(T,)](
        # the new rows and where each goes
        k_ptr=k, v_ptr=v, stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1),
        slot_ptr=slot_mapping, num_kv_heads=kvh, head_dim=d,
        # the paged cache and its scales
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_size=k_cache.shape[1],
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        k_scale_ptr=scale_k, v_scale_ptr=scale_v, stride_sb=stride_sb, stride_ss=stride_ss,
        # modes and tile shapes
        QUANT=quant, SCALE_PER_TOKEN=per_token, IS_INT8=k_cache.dtype == torch.int8,
        QMAX_=QMAX.get(k_cache.dtype, 1.0), MIN_SCALE_=MIN_SCALE,
        BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
    )


# --------------------------------------------------------------------------- references (plain torch)
def reference_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> None:
    """Plain-torch oracle (and CPU path) for ``store_kv``; writes in place."""
    if validate:
        _check_store(k, v, k_cache, v_cache, slot_mapping)
        check_kv_scales(k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    store_rows(k_cache, k_scale, k[keep], slot_mapping[keep])
    store_rows(v_cache, v_scale, v[keep], slot_mapping[keep])
