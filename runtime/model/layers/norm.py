"""RMSNorm with the numerics of transformers' Llama and Gemma 3 norms."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` computed in fp32.

    ``offset=0`` (Llama, Qwen, Mistral): the normalised input is cast back to the input dtype,
    then multiplied by the weight. ``offset=1`` (Gemma): the stored weight is a delta from 1 and
    the product ``x * (1 + weight)`` is formed in fp32 before the cast.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)
