"""A Linear over compressed-tensors weights that runs through ``dispatch.quantized_linear``:
the fused Triton dequant-matmul kernels (or ``torch._scaled_mm`` for FP8 W8A8) once its buffers
are on CUDA, the plain-torch reference on CPU unless ``use_triton`` (the interpreter). Weights stay
as stored (packed int32 / FP8)."""
from __future__ import annotations

import torch
from torch import nn

from foundation.schemes import QuantScheme
from runtime.kernels.dispatch import WeightScheme, quantized_linear

TENSOR_NAMES = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")


class KernelLinear(nn.Module):
    """``y = x @ W.T + b`` for one quantized Linear; ``tensors`` as on disk, relative to it."""

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias: torch.Tensor | None = None,
                 use_triton: bool | None = None):
        super().__init__()
        self.scheme = WeightScheme.from_scheme(scheme)
        if use_triton is False:
            self.kernel = "dequantize + GEMM (torch reference)"
        else:
            self.kernel = "torch._scaled_mm (FP8 GEMM)" if scheme.input_activations else "Triton dequant-matmul"
        self.use_triton = use_triton
        self.names = tuple(n for n in TENSOR_NAMES if n in tensors)
        for name in self.names:
            self.register_buffer(name, tensors[name].contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = {n: getattr(self, n) for n in self.names}
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return quantized_linear(x, self.scheme, tensors, bias, self.use_triton)
