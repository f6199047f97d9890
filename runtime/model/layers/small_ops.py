"""The decode step's small ops between its GEMMs: the residual add with the RMSNorm after it, the
queries' rotary, and the gated MLP's ``act(gate) * up``.

``SmallOps(fused=False)``: torch's expressions (the CPU path, and the references); ``fused=True``
(Triton kernels, the GPU's placement): one launch each (``runtime.kernels.add_rms_norm``,
``runtime.kernels.rotary``, ``runtime.kernels.gated_activation``) where torch runs ~8 for a norm,
5 for a rotary and 2 for the activation. Both give the same numerics: the residual stream rounded
to the activation dtype after each add.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.attention.key_rope import apply_rotary
from runtime.model.layers.norm import RMSNorm


@dataclass(frozen=True)
class SmallOps:
    fused: bool = False

    def __post_init__(self) -> None:
        kernels = None
        if self.fused:  # the Triton kernels, imported once here rather than on every call of a step
            from runtime.kernels.add_rms_norm import add_rms_norm
            from runtime.kernels.gated_activation import gated_activation
            from runtime.kernels.rotary import rotary

            kernels = (add_rms_norm, rotary, gated_activation)
        object.__setattr__(self, "_kernels", kernels)

    def add_norm(self, h: torch.Tensor, pending: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h + pending, norm(h + pending))``; ``pending`` None: ``(h, norm(h))``."""
        if self._kernels:
            return self._kernels[0](h, pending, norm.weight, norm.eps, norm.offset)
        if pending is not None:
            h = h + pending
        return h, norm(h)

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self.add_norm(x, None, norm)[1]

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, heads, head_dim]`` rotated (rotate-half) by ``cos``, ``sin`` ``[T, 1, head_dim]``."""
        if self._kernels:
            return self._kernels[1](x, cos, sin)
        return apply_rotary(x, cos, sin)

    def gated(self, gate: torch.Tensor, up: torch.Tensor, act_name: str,
              act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(gate) * up`` (``act``: the torch function of ``act_name``, the kernel's activation)."""
        if self._kernels:
            return self._kernels[2](gate, up, act_name)
        return act(gate) * up
