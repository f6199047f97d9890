"""Linear layers for every weight storage the runtime serves, dispatched on the declared scheme.

- ``DenseLinear``: fp32 / bf16 / fp16 weights.
- ``Fp8Linear``: ``float-quantized`` FP8 E4M3 weight + scale; dequantized per forward; with the
  FP8_DYNAMIC scheme the input is fake-quantized to FP8 per token first (what an FP8 GEMM sees).
- ``Fp8DequantizedLinear``: the same on a CPU, which has no FP8 GEMM: the weight dequantized once
  at load into the activation dtype (2x the FP8 bytes resident in bf16), so decode runs at the
  dense model's speed instead of dequantizing every weight on every forward.
- ``W8A8Linear``: ``int-quantized`` INT8 per-channel weight + scale (W8A8). The input is quantized
  per token to INT8 (compressed-tensors' dynamic symmetric token quantization) and multiplied by
  the INT8 weight with ``torch._int_mm`` (int32 accumulation), then rescaled by the token and
  channel scales; ``use_int_mm=False`` (or a shape the kernel refuses) takes the plain-torch
  fake-quantize + dequantize reference path.
- ``PackedIntLinear``: ``pack-quantized`` INT4 / INT8 (W4A16, W8A16, symmetric or not, group or
  channel, act-order). Keeps the on-disk int32 words and dequantizes per forward with
  ``foundation.primitives.dequantize_linear`` (bit-identical to compressed-tensors).
- ``Int8PackLinear`` / ``Int4PackLinear``: the same weights repacked for torch's CPU weight-only
  kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``), used with bf16
  activations, where they beat dequantize-then-matmul; same bytes as the packed weights.

Weights stay compressed in memory (every class but ``Fp8DequantizedLinear`` holds at most the
on-disk bytes of its weight plus a small per-group overhead). ``make_linear`` picks the class.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foundation.activation_quant import (
    fake_quantize_fp8_per_token,
    fake_quantize_int8_per_token,
    quantize_int8_per_token,
)
from foundation.errors import CheckpointError, KvslimError
from foundation.primitives import FP8_DTYPE, decode_linear, dequantize_linear
from foundation.schemes import QuantScheme

INT4_KERNEL_GROUPS = (32, 64, 128, 256)


def _buffer(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    module.register_buffer(name, None if t is None else t.contiguous(), persistent=False)


class DenseLinear(nn.Module):
    kernel = "dense GEMM"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        _buffer(self, "weight", weight.to(dtype))
        _buffer(self, "bias", None if bias is None else bias.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# torch._int_mm on CUDA needs more than 16 rows and K, N multiples of 8; CPU takes every shape.
CUDA_INT_MM_MIN_ROWS = 17


def int8_matmul(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``q [M, K] int8 @ weight [N, K]^T`` accumulated in int32 by ``torch._int_mm``, or None where
    that kernel cannot run. On CUDA fewer than 17 rows are padded with zero rows (which add
    nothing) and sliced off, so decode batches keep the int8 GEMM instead of widening the weight."""
    m, k = q.shape
    n = weight.shape[0]
    if m == 0 or q.device.type not in ("cpu", "cuda"):
        return None
    if q.device.type == "cuda":
        if k % 8 or n % 8:
            return None
        if m < CUDA_INT_MM_MIN_ROWS:
            q = F.pad(q, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - m))
    int_mm = torch.ops.kvslim.int_mm if torch.compiler.is_compiling() else torch._int_mm
    return int_mm(q, weight.t())[:m]  # [N, K] row-major as stored: its .t() is the fast layout


@torch.library.custom_op("kvslim::int_mm", mutates_args=())
def _opaque_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm`` kept out of compiled graphs (``runtime.model.decode_graphs``): under
    ``torch.compile`` it measured 19 ms against 47 us eager at one row."""
    return torch._int_mm(a, b)


@_opaque_int_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)


class _QuantizedLinear(nn.Module):
    """Common parts: shapes, bias, the scheme, and the dequantized reference weight."""

    scheme: QuantScheme

    def __init__(self, scheme: QuantScheme, shape: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.scheme = scheme
        self.out_features, self.in_features = shape
        self.dtype = dtype
        _buffer(self, "bias", None if bias is None else bias.to(dtype))

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.describe()}"


class Fp8Linear(_QuantizedLinear):
    kernel = "FP8 dequantize + GEMM"
    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype):
        super().__init__(scheme, tuple(tensors["weight"].shape), bias, dtype)
        _buffer(self, "weight", tensors["weight"])
        _buffer(self, "weight_scale", tensors["weight_scale"])

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_linear({"weight": self.weight, "weight_scale": self.weight_scale}, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.input_activations is not None:
            x = fake_quantize_fp8_per_token(x)
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


class Fp8DequantizedLinear(_QuantizedLinear):
    """FP8 weights for a device without FP8 GEMMs: dequantized once, stored in the activation dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype):
        super().__init__(scheme, tuple(tensors["weight"].shape), bias, dtype)
        self.kernel = ("FP8 dequantized once at load, activations FP8 per token (dense GEMM)"
                       if scheme.input_activations is not None else "FP8 dequantized once at load (dense GEMM)")
        weight = dequantize_linear({"weight": tensors["weight"], "weight_scale": tensors["weight_scale"]}, scheme)
        _buffer(self, "weight", weight.to(dtype))

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.input_activations is not None:
            x = fake_quantize_fp8_per_token(x)
        return F.linear(x, self.weight.to(x.dtype), self.bias)


class W8A8Linear(_QuantizedLinear):
    """``int-quantized`` W8A8: int8 weight ``[out, in]`` and per-channel scales, both kept as stored."""

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype, use_int_mm: bool = True):
        super().__init__(scheme, tuple(tensors["weight"].shape), bias, dtype)
        self.use_int_mm = use_int_mm
        self.kernel = "torch._int_mm (INT8 GEMM)" if use_int_mm else "fake-quantize + dequantize + GEMM"
        _buffer(self, "weight", tensors["weight"])
        _buffer(self, "weight_scale", tensors["weight_scale"])

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_linear({"weight": self.weight, "weight_scale": self.weight_scale}, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_int_mm:
            return F.linear(fake_quantize_int8_per_token(x), self.dequantized_weight().to(x.dtype), self.bias)
        lead = x.shape[:-1]
        q, x_scale = quantize_int8_per_token(x.reshape(-1, self.in_features))
        acc = int8_matmul(q, self.weight)
        if acc is None:
            acc = F.linear(q.float(), self.weight.float())
        # In place; a bf16/fp16 scale widens to fp32 exactly, as .float() would.
        y = acc.float().mul_(x_scale).mul_(self.weight_scale.reshape(-1)).to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)


class PackedIntLinear(_QuantizedLinear):
    """``pack-quantized`` weights kept as stored; dequantized per forward."""

    kernel = "dequantize + GEMM"

    NAMES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype):
        shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
        super().__init__(scheme, shape, bias, dtype)
        for name in self.NAMES:
            _buffer(self, name, tensors.get(name))

    def dequantized_weight(self) -> torch.Tensor:
        tensors = {n: getattr(self, n) for n in self.NAMES if getattr(self, n) is not None}
        return dequantize_linear(tensors, self.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


class Int8PackLinear(_QuantizedLinear):
    """Symmetric per-channel INT8 for ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations)."""

    kernel = "_weight_int8pack_mm (bf16)"

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype):
        q, scale, _, _ = decode_linear(tensors, scheme)
        super().__init__(scheme, tuple(q.shape), bias, dtype)
        _buffer(self, "weight_int8", q)
        _buffer(self, "scale", scale.reshape(-1).to(dtype))

    @staticmethod
    def supports(scheme: QuantScheme, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
        return (dtype == torch.bfloat16 and scheme.num_bits == 8 and scheme.symmetric
                and scheme.strategy == "channel" and "weight_g_idx" not in tensors)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8, self.scale)
        y = y.reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias


class Int4PackLinear(_QuantizedLinear):
    """INT4 (group or channel, symmetric or not) for ``_weight_int4pack_mm_for_cpu`` (bf16).

    The kernel computes ``w = (u - 8) * scale + zero`` with ``u`` the unsigned nibble; a
    compressed-tensors value ``q = u - 8`` with zero point ``zp`` is ``(q - zp) * scale``, so
    ``zero = -zp * scale``.
    """

    kernel = "_weight_int4pack_mm_for_cpu (bf16)"

    def __init__(self, tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias, dtype):
        q, scale, zp, _ = decode_linear(tensors, scheme)
        super().__init__(scheme, tuple(q.shape), bias, dtype)
        out, cols = q.shape
        self.group_size = int(scheme.group_size or cols)
        unsigned = (q.to(torch.int32) + 8).contiguous()
        _buffer(self, "weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        scale = scale.reshape(out, -1).float()
        zero = torch.zeros_like(scale) if zp is None else -zp.reshape(out, -1).float() * scale
        _buffer(self, "scale_and_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(dtype))

    @staticmethod
    def supports(scheme: QuantScheme, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bool:
        out, cols = (int(v) for v in tensors["weight_shape"].tolist())
        group = int(scheme.group_size or cols)
        return (dtype == torch.bfloat16 and scheme.num_bits == 4 and "weight_g_idx" not in tensors
                and out % 16 == 0 and group in INT4_KERNEL_GROUPS and cols % group == 0)

    def dequantized_weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return self.forward_nobias(eye).t()

    def forward_nobias(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features), self.weight_int4, self.group_size, self.scale_and_zeros
        )
        return y.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.forward_nobias(x)
        return y if self.bias is None else y + self.bias


def make_linear(
    name: str,
    tensors: dict[str, torch.Tensor],
    scheme: QuantScheme | None,
    dtype: torch.dtype,
    use_cpu_kernels: bool = True,
    kernels: str = "torch",
    interpreted: bool = False,
    int8_gemm: bool = True,
) -> nn.Module:
    """Build the Linear for module ``name`` from its checkpoint tensors (names relative to it).

    ``scheme`` is the declared quantization of this Linear (``None``: floating point).
    ``use_cpu_kernels=False`` forces the dequantize-per-forward path (the numerical reference; for
    W8A8: fake-quantized activations times the dequantized weight instead of ``torch._int_mm``);
    with it (the loader's choice on a CPU), FP8 weights are dequantized once at load.
    ``kernels="triton"``: weight-only INT4/INT8 and FP8 Linears run the Triton dequant-matmul
    (``KernelLinear``; ``interpreted``: forced on the CPU, under Triton's interpreter).
    ``int8_gemm=False``: W8A8 never calls ``torch._int_mm`` (a CPU without VNNI, where torch's
    fallback is ~100x slower): its reference path runs instead (``runtime.model.layers.cpu_kernels``).
    """
    bias = tensors.get("bias")
    check_linear_tensors(name, tensors, scheme)
    if scheme is None:
        return DenseLinear(tensors["weight"], bias, dtype)
    kernel = _kernel_linear(tensors, scheme, bias, interpreted) if kernels == "triton" else None
    if kernel is not None:
        return kernel
    if not scheme.is_packed:
        if scheme.type != "float":
            return W8A8Linear(tensors, scheme, bias, dtype, use_int_mm=use_cpu_kernels and int8_gemm)
        return (Fp8DequantizedLinear if use_cpu_kernels else Fp8Linear)(tensors, scheme, bias, dtype)
    if use_cpu_kernels and Int4PackLinear.supports(scheme, tensors, dtype):
        return Int4PackLinear(tensors, scheme, bias, dtype)
    if use_cpu_kernels and Int8PackLinear.supports(scheme, tensors, dtype):
        return Int8PackLinear(tensors, scheme, bias, dtype)
    return PackedIntLinear(tensors, scheme, bias, dtype)


def linear_kernels(model: nn.Module) -> dict[str, int]:
    """How many Linears of ``model`` run each kernel (``kernel`` attribute), most used first."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, str):
            counts[kernel] = counts.get(kernel, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def check_linear_tensors(name: str, tensors: dict[str, torch.Tensor], scheme: QuantScheme | None) -> None:
    """Raise a one-line ``CheckpointError`` unless ``tensors`` hold what ``scheme`` declares (``None``:
    a floating-point weight)."""
    if scheme is None:
        if "weight" not in tensors or not tensors["weight"].is_floating_point() or tensors["weight"].dtype == FP8_DTYPE:
            raise CheckpointError(f"{name}: expected a floating-point weight (no quantization declared for it)")
        return
    needed = ("weight", "weight_scale") if not scheme.is_packed else ("weight_packed", "weight_scale", "weight_shape")
    if not scheme.symmetric and scheme.is_packed:
        needed += ("weight_zero_point",)
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise CheckpointError(f"{name}: scheme {scheme.name} needs tensors {', '.join(name + '.' + m for m in missing)}")
    if scheme.is_packed:
        if tensors["weight_packed"].dtype != torch.int32:
            raise CheckpointError(f"{name}.weight_packed must be int32, found {tensors['weight_packed'].dtype}")
        return
    rows, scales = tensors["weight"].shape[0], tensors["weight_scale"].numel()
    if scheme.strategy == "channel" and scales != rows:
        raise CheckpointError(f"{name}.weight_scale has {scales} values, per-channel {scheme.name} needs {rows}")
    if scheme.type == "float" and tensors["weight"].dtype != FP8_DTYPE:
        raise CheckpointError(f"{name}.weight is {tensors['weight'].dtype}, scheme {scheme.name} declares FP8")
    if scheme.type != "float":
        if scheme.input_activations is None:
            raise CheckpointError(f"{name}: unpacked integer weights without activation quantization are not supported")
        if tensors["weight"].dtype != torch.int8:
            raise CheckpointError(f"{name}.weight is {tensors['weight'].dtype}, scheme {scheme.name} declares int8")


def _kernel_linear(tensors: dict[str, torch.Tensor], scheme: QuantScheme, bias: torch.Tensor | None,
                   interpreted: bool) -> nn.Module | None:
    """The Triton dequant-matmul Linear for a scheme it computes (weight-only INT4/INT8, FP8; tensors
    already checked); None for the others (W8A8 INT8 keeps ``torch._int_mm``)."""
    from runtime.kernels.dispatch import WeightScheme
    from runtime.kernels.kernel_linear import KernelLinear

    try:
        WeightScheme.from_scheme(scheme)
    except KvslimError:
        return None
    if scheme.type == "float" and scheme.input_activations is not None and interpreted:
        return None  # FP8 activations: the interpreter's fp32 -> fp8 casts are wrong; the torch path
    return KernelLinear({k: v for k, v in tensors.items() if k != "bias"}, scheme, bias,
                        use_triton=True if interpreted else None)
