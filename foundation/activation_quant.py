"""Dynamic per-token activation quantization, exactly as compressed-tensors applies it at serving.

FP8_DYNAMIC and W8A8 quantize every Linear's input on the fly; the runtime does it when serving
and GPTQ does it while calibrating, so both use these functions.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from foundation.primitives import FP8_DTYPE
from foundation.schemes import ActivationQuant

FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0
# compressed-tensors' symmetric scale divides the absolute maximum by half the integer range:
# (127 - (-128)) / 2 = 127.5, so the largest value lands on 127.5 and clamps to 127.
INT8_HALF_RANGE = 127.5


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token FP8: ``(q fp8 [..., K], scale fp32 [..., 1])``, ``x ~ q * scale``.

    compressed-tensors' dynamic ``token`` strategy for ``float`` 8-bit activations:
    ``scale = amax / 448`` (fp32 eps for an all-zero row), rounded to x's dtype.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale).to(x.dtype).float()
    return torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fake_quantize_fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize of ``quantize_fp8_per_token`` (``q * scale``), in x's dtype."""
    q, scale = quantize_fp8_per_token(x)
    return (q.float() * scale).to(x.dtype)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token INT8: ``(q int8 [..., K], scale [..., 1] in x's dtype)``.

    compressed-tensors' ``token`` strategy for ``int`` 8-bit activations, in x's dtype:
    ``scale = amax / 127.5`` (the dtype's eps where 0), ``q = round(clamp(x / scale, -128, 127))``
    with round half to even.
    """
    scale = x.abs().amax(dim=-1, keepdim=True).div_(INT8_HALF_RANGE)
    scale.masked_fill_(scale == 0, torch.finfo(x.dtype).eps)
    q = torch.div(x, scale).clamp_(INT8_MIN, INT8_MAX).round_()  # in place: 40% faster at decode sizes
    return q.to(torch.int8), scale


def fake_quantize_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize of ``quantize_int8_per_token`` (``q * scale``), in x's dtype."""
    q, scale = quantize_int8_per_token(x)
    return q.to(x.dtype) * scale


def activation_fake_quantizer(acts: ActivationQuant | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The quantize-dequantize a runtime applies to a Linear's input under ``acts`` (None: none)."""
    if acts is None:
        return None
    if not (acts.dynamic and acts.strategy == "token" and acts.symmetric and acts.num_bits == 8):
        raise ValueError(f"no fake quantizer for {acts.describe()}")
    return fake_quantize_fp8_per_token if acts.type == "float" else fake_quantize_int8_per_token


class LinearInputQuantizer:
    """Within: every ``nn.Linear`` of ``module`` (those whose name ``select`` accepts; all by
    default) sees ``fn(input)`` instead of its input, as a runtime serving FP8_DYNAMIC / W8A8 feeds
    it. Linears reading the same tensor get the same quantized tensor (GPTQ's shared Hessians)."""

    def __init__(self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
                 select: Callable[[str], bool] | None = None) -> None:
        self.module, self.fn, self.select = module, fn, select
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles: list = []

    def _hook(self, _module, args):
        x = args[0]
        if self._last is None or self._last[0] is not x:
            self._last = (x, self.fn(x))
        return (self._last[1], *args[1:])

    def __enter__(self) -> "LinearInputQuantizer":
        self._handles = [m.register_forward_pre_hook(self._hook) for n, m in self.module.named_modules()
                         if isinstance(m, nn.Linear) and (self.select is None or self.select(n))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._last = [], None
