"""Route a quantized Linear by device and declared scheme: CUDA tensors to the Triton kernels (or
``torch._scaled_mm`` for FP8 W8A8), CPU tensors to the plain-torch reference paths;
``use_triton=True`` sends CPU tensors to the Triton kernels too (Triton's interpreter, for tests
and ``--kernels triton`` on a machine without a GPU). Attention chooses its kernels once, in
``runtime.attention.triton_backend``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme
from runtime.kernels import dequant_matmul as dm


@dataclass(frozen=True)
class WeightScheme:
    """A linear layer's declared weight scheme (one compressed-tensors config group).

    ``kind="int"``: ``pack-quantized`` INT4/INT8 weight-only (tensors ``weight_packed``,
    ``weight_scale``, optional ``weight_zero_point`` / ``weight_g_idx``). ``kind="float"``: FP8
    per-channel (``weight``, ``weight_scale``), with ``fp8_activations`` for W8A8 dynamic.
    """

    kind: Literal["int", "float"]
    num_bits: int
    symmetric: bool = True
    fp8_activations: bool = False

    @classmethod
    def from_scheme(cls, scheme: QuantScheme) -> "WeightScheme":
        """The kernel family of a declared ``QuantScheme``; refuse one no kernel here computes."""
        acts = scheme.input_activations
        if scheme.type == "int" and scheme.num_bits in (4, 8) and acts is None:
            return cls("int", scheme.num_bits, scheme.symmetric)
        if scheme.type == "float" and scheme.num_bits == 8 and scheme.strategy == "channel":
            fp8_acts = acts is not None and acts.type == "float" and acts.dynamic
            if acts is not None and not fp8_acts:
                raise KvslimError(f"FP8 weights with activations {acts.describe()} have no kernel (only dynamic FP8 per-token)")
            return cls("float", 8, True, fp8_acts)
        raise KvslimError(f"no kernel for weight scheme {scheme.describe()}")


def _on_cuda(x: torch.Tensor) -> bool:
    return x.device.type == "cuda"


def _triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return _on_cuda(x) if use_triton is None else use_triton


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise KvslimError(f"quantized linear is missing tensor {name!r} (has {sorted(tensors)})")
    return tensors[name]


def quantized_linear(
    x: torch.Tensor,
    scheme: WeightScheme,
    tensors: Mapping[str, torch.Tensor],
    bias: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through a compressed-tensors weight (tensor names as on disk,
    without the module prefix). FP8 W8A8 takes ``torch._scaled_mm`` on an sm_89+ GPU only."""
    x2 = x.reshape(-1, x.shape[-1])
    if scheme.kind == "int":
        zp = tensors.get("weight_zero_point")
        if scheme.symmetric == (zp is not None):
            raise KvslimError(f"scheme symmetric={scheme.symmetric} but weight_zero_point is {'present' if zp is not None else 'absent'}")
        args = (_tensor(tensors, "weight_packed"), _tensor(tensors, "weight_scale"), scheme.num_bits, zp, tensors.get("weight_g_idx"))
        fn = dm.int_weight_matmul if _triton(x2, use_triton) else dm.reference_int_weight_matmul
        y = fn(x2, *args)
    else:
        w, s = _tensor(tensors, "weight"), _tensor(tensors, "weight_scale")
        if scheme.fp8_activations:
            hopper = _on_cuda(x2) and torch.cuda.get_device_capability(x2.device) >= (8, 9)
            y = dm.fp8_w8a8_matmul(x2, w, s) if hopper else dm.reference_fp8_w8a8_matmul(x2, w, s)
        else:
            y = dm.fp8_weight_matmul(x2, w, s) if _triton(x2, use_triton) else dm.reference_fp8_weight_matmul(x2, w, s)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
