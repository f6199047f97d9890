"""Rotary embedding (rotate-half) of one step's queries or keys in one Triton launch.

``rotary(x, cos, sin)``: ``x [T, heads, head_dim]`` (any token and head strides, e.g. views of the
fused QKV GEMM's output), ``cos``/``sin`` ``[T, 1, head_dim]`` in x's dtype -> a new contiguous
``[T, heads, head_dim]``. The numerics are ``key_rope.apply_rotary``'s (the reference it is tested
against): ``x * cos`` and ``rotate_half(x) * sin`` each rounded to the dtype, then their sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, head_dim,
                  stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(T,)``: program t rotates every head of token t."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    half = head_dim // 2
    ok = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    rows = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    x = tl.load(rows + offs_d[None, :], mask=ok, other=0.0)
    p = tl.load(rows + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    d_ok = offs_d < head_dim
    c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c[None, :]).to(x.dtype).to(tl.float32)
    b = (p * sign[None, :] * s[None, :]).to(x.dtype).to(tl.float32)
    dst = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, (a + b).to(out_ptr.dtype.element_ty), mask=ok)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, head_dim]`` rotated by ``cos``, ``sin`` ``[T, 1, head_dim]``."""
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        raise KvslimError(f"rotary: x must be [T, heads, head_dim] (even head_dim, unit inner stride), "
                          f"got {tuple(x.shape)} strides {x.stride()}")
    t, heads, d = x.shape
    if cos.shape != (t, 1, d) or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise KvslimError(f"rotary: cos and sin must be [{t}, 1, {d}] with equal strides, got "
                          f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
    if t and heads:
        rotary_kernel[(t,)](x, cos, sin, out, heads, d, x.stride(0), x.stride(1), cos.stride(0),
                            out.stride(0), out.stride(1),
                            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d))
    return out
