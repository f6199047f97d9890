"""The gated MLP's ``act(gate) * up`` in one Triton launch (vLLM's ``silu_and_mul``).

``gate`` and ``up`` ``[T, I]`` may be views of one fused gate-up GEMM's output (any row stride).
The numerics are the torch expression's (``runtime.model.layers.mlp``, the reference it is tested
against): the activation computed in fp32 and rounded to the dtype, then the product rounded again.
tanh-GELU is written ``x * sigmoid(2z)``, which equals ``0.5 x (1 + tanh(z))`` (Triton has no tanh
in its interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # HF hidden_act -> the kernel's ACT
GELU_C = 0.7978845608028654  # sqrt(2 / pi)
BLOCK = 1024


@triton.jit
def gated_activation_kernel(gate_ptr, up_ptr, out_ptr, width, stride_g, stride_u, stride_o,
                            ACT: tl.constexpr, BLOCK_: tl.constexpr, GELU_C_: tl.constexpr):
    """Grid ``(T, cdiv(I, BLOCK_))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_ + tl.arange(0, BLOCK_)
    ok = cols < width
    g = tl.load(gate_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(up_ptr + row * stride_u + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    if ACT == 0:
        z = gf
    else:
        z = 2.0 * GELU_C_ * (gf + 0.044715 * gf * gf * gf)
    a = gf * tl.sigmoid(tl.minimum(tl.maximum(z, -80.0), 80.0))  # clamped: exp stays finite, sigmoid saturated
    y = a.to(g.dtype).to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` ``[T, I]`` in their dtype; ``act`` an HF ``hidden_act`` name."""
    if act not in ACTIVATIONS:
        raise KvslimError(f"gated_activation: unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
    if gate.dim() != 2 or up.shape != gate.shape or up.dtype != gate.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise KvslimError(f"gated_activation: gate and up must be equal [T, I] with unit inner stride, got "
                          f"{gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)}")
    t, width = gate.shape
    out = torch.empty((t, width), dtype=gate.dtype, device=gate.device)
    if t:
        grid = (t, triton.cdiv(width, BLOCK))
        gated_activation_kernel[grid](gate, up, out, width, gate.stride(0), up.stride(0), out.stride(0),
                                      ACT=ACTIVATIONS[act], BLOCK_=BLOCK, GELU_C_=GELU_C)
    return out
