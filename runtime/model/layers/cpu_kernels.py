"""Which CPU kernels a checkpoint's Linears run, decided once from the CPU's features at load.

- W8A8 (INT8 weights and activations): ``torch._int_mm`` only on a CPU with VNNI. Without it,
  torch's int8 GEMM falls back to a path ~100x slower (or, on some builds, wrong sums), so the
  fake-quantize + dequantize reference runs instead (the same numbers, within rounding).
- W4A16 / W8A16: torch's weight-only kernels (``_weight_int4pack_mm_for_cpu``,
  ``_weight_int8pack_mm``) with bf16 activations, which ``dtype=auto`` picks on a CPU with native
  bf16 (AVX512_BF16 or AMX: ``activation_dtype``); with fp32 activations, dequantize + GEMM.
- Everything else: dense (oneDNN) GEMMs in the activation dtype.

No graph containing ``torch._int_mm`` is ever compiled: under ``torch.compile`` it measured 19 ms
against 47 us eager at one row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model.layers.activation_dtype import CpuFeatures


@dataclass(frozen=True)
class CpuKernelChoice:
    features: CpuFeatures
    int8_gemm: bool  # W8A8 through torch._int_mm
    weight_only_kernels: bool  # torch's INT4/INT8 weight-only kernels (they take bf16 activations)

    @classmethod
    def choose(cls, dtype: torch.dtype, features: CpuFeatures | None = None) -> "CpuKernelChoice":
        """The choice for activations in ``dtype`` on a CPU with ``features`` (None: this CPU's)."""
        features = features or CpuFeatures.detect()
        return cls(features, int8_gemm=features.vnni, weight_only_kernels=dtype == torch.bfloat16)

    def describe(self) -> str:
        int8 = "W8A8 via torch._int_mm (VNNI)" if self.int8_gemm else "W8A8 via dequantize + GEMM (no VNNI)"
        weight_only = ("INT4/INT8 weight-only via torch's packed kernels (bf16)" if self.weight_only_kernels
                       else "INT4/INT8 weight-only via dequantize + GEMM (fp32 activations)")
        return f"CPU {self.features.describe()}: {int8}; {weight_only}"
