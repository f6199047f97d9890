"""Linears that read the same input (q/k/v, gate/up), computed as one GEMM and split back.

The loader stacks the parts' checkpoint tensors along the output dimension
(``stack_linear_tensors``) and builds one Linear of the shared scheme from them with
``make_linear``, so every storage the runtime serves (dense, FP8, W8A8 int8 with per-channel
scales, packed INT4/INT8 and the CPU kernel repacks) fuses the same way. Parts that cannot be stacked (differing schemes or act-order
column orders) run one by one (``SeparateLinears``); both forms return one output per part.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from foundation.primitives import FP8_DTYPE, decode_linear, encode_linear
from foundation.schemes import QuantScheme


class FusedLinear(nn.Module):
    """One Linear over the parts' stacked weights; ``forward`` returns each part's output (views)."""

    def __init__(self, linear: nn.Module, sizes: Sequence[int]) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = tuple(int(s) for s in sizes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"split={self.sizes}"


class SeparateLinears(nn.Module):
    """The unfused form: each part on its own, same outputs as ``FusedLinear``."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        super().__init__()
        self.linears = nn.ModuleList(linears)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear in self.linears)


def _cat_rows(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    if ts[0].dtype == FP8_DTYPE:  # CPU cat has no fp8 kernel: stack the bytes
        return torch.cat([t.view(torch.uint8) for t in ts]).view(FP8_DTYPE)
    return torch.cat(list(ts))


def out_features(tensors: dict[str, torch.Tensor]) -> int:
    """Output rows of one Linear's checkpoint tensors."""
    if "weight_shape" in tensors:
        return int(tensors["weight_shape"][0])
    return int(tensors["weight"].shape[0])


def in_features(tensors: dict[str, torch.Tensor]) -> int:
    """Input columns of one Linear's checkpoint tensors."""
    if "weight_shape" in tensors:
        return int(tensors["weight_shape"][1])
    return int(tensors["weight"].shape[1])


def stack_linear_tensors(
    parts: Sequence[dict[str, torch.Tensor]], scheme: QuantScheme | None
) -> dict[str, torch.Tensor] | None:
    """The checkpoint tensors of one Linear whose output rows are ``parts``' rows in order, or
    None when they cannot be stacked. All parts share ``scheme`` and bias presence (the caller
    checked). Scales and zero points are per output row, so rows stack; packed words are
    unpacked, stacked and repacked (exact). Act-order parts stack only with one column order."""
    bias = [p.get("bias") for p in parts]
    out: dict[str, torch.Tensor] = {}
    if scheme is None:
        out["weight"] = _cat_rows([p["weight"] for p in parts])
    else:
        decoded = [decode_linear(p, scheme) for p in parts]
        g_idx = [d[3] for d in decoded]
        if any((g is None) != (g_idx[0] is None) or (g is not None and not torch.equal(g, g_idx[0])) for g in g_idx):
            return None
        zps = [d[2] for d in decoded]
        out = encode_linear(
            _cat_rows([d[0] for d in decoded]),
            torch.cat([d[1] for d in decoded]),
            None if zps[0] is None else torch.cat(zps),
            scheme,
            g_idx[0],
        )
    if bias[0] is not None:
        out["bias"] = torch.cat(bias)
    return out
