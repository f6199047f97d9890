"""The residual add and the RMSNorm after it, in one Triton launch per step (vLLM's ``fused_add_rms_norm``).

``add_rms_norm(x, residual, weight, eps, offset)`` returns ``(s, norm(s))`` with ``s = x + residual``
(``residual`` None: ``s = x``), each row ``[hidden]`` read once. The numerics are ``RMSNorm``'s
(``runtime.model.layers.norm``, the reference it is tested against) and the torch add's: ``s`` is
rounded to ``x``'s dtype, the mean of squares taken in fp32, and with ``offset == 0`` (Llama) the
normalised row is rounded to the dtype before the weight multiplies it; with an offset (Gemma) the
product ``s * (offset + weight)`` is formed in fp32 and rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr, hidden, eps, offset,
    stride_x, stride_r, stride_s, stride_o,
    HAS_RESIDUAL: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(T,)``: program t adds and normalises row t."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the torch add, rounded to the dtype
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        y = xf * rstd * (offset + w)
    else:
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (and ``residual``) ``[T, hidden]`` -> ``(x + residual, RMSNorm(x + residual))``, both in
    ``x``'s dtype; ``weight [hidden]`` (fp32 with an offset, else ``x``'s dtype)."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(-1) != 1:
        raise KvslimError(f"add_rms_norm: x must be [T, hidden] bf16/fp16/fp32 with unit inner stride, "
                          f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise KvslimError(f"add_rms_norm: residual must match x ({x.dtype} {tuple(x.shape)}), "
                          f"got {residual.dtype} {tuple(residual.shape)}")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise KvslimError(f"add_rms_norm: weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    t, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if t:
        add_rms_norm_kernel[(t,)](
            x, residual if residual is not None else x, weight, total, out, hidden, float(eps), float(offset),
            x.stride(0), (residual if residual is not None else x).stride(0), total.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, HAS_OFFSET=bool(offset), BLOCK=triton.next_power_of_2(hidden),
        )
    return total, out
