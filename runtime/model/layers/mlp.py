"""Gated MLP: ``down(act(gate(x)) * up(x))`` (SiLU for Llama/Qwen/Mistral, tanh-GELU for Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.layers.small_ops import SmallOps


def activation(name: str):
    """The activation function for an HF ``hidden_act`` name (``ModelSpec`` validated it)."""
    if name == "silu":
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name}")


class GatedMLP(nn.Module):
    """``gate_up_proj(x)`` returns ``(gate, up)``: one fused GEMM or two Linears
    (``runtime.model.layers.fused_linear``)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act: str, ops: SmallOps = SmallOps()) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.act_name = act
        self.act = activation(act)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.ops.gated(gate, up, self.act_name, self.act))
