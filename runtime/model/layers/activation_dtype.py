"""The activation dtype a checkpoint runs with: chosen once, beside the kernel choice (``make_linear``).

``dtype="auto"`` (the default of ``LLM``, ``Engine`` and every command that runs a checkpoint)
picks by the CPU's features, and names the checkpoint's weight storage in its reason:

- CUDA: bfloat16.
- A CPU with native bf16 (AVX512_BF16 or AMX): bfloat16, for every weight storage. torch's
  weight-only INT4/INT8 CPU kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``)
  take bf16 activations only (fp32 falls back to dequantize-then-matmul), and oneDNN's bf16 GEMMs
  beat fp32 for the rest. Decode tok/s bf16 / fp32 on 2 idle cores with AVX-512 + VNNI +
  AVX512_BF16 at batch 1 / 8 (``benchmarks/activation_dtype.py speed``): dense 1.88x / 2.25x,
  INT4 4.85x / 3.17x, INT8 7.96x / 3.90x, FP8 weight-only 1.03x / 1.26x, FP8_DYNAMIC 1.18x /
  1.19x, W8A8 1.20x / 1.22x.
- A CPU without native bf16 (AVX2 only): float32, which such a CPU runs faster (bf16 is emulated).

An explicit dtype always wins. bf16 activations move logits: the figures are in BENCHMARKS.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme
from runtime.model.layers.dtype_choices import AUTO, DTYPE_CHOICES, DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def _has(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # private probes; absent on some torch builds
    return bool(probe()) if probe is not None else False


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set extensions that decide which CPU kernels are fast."""

    avx2: bool
    avx512: bool
    vnni: bool
    avx512_bf16: bool
    amx: bool

    @classmethod
    def detect(cls) -> "CpuFeatures":
        return cls(avx2=_has("_is_avx2_supported"), avx512=_has("_is_avx512_supported"),
                   vnni=_has("_is_vnni_supported"), avx512_bf16=_has("_is_avx512_bf16_supported"),
                   amx=_has("_is_amx_tile_supported"))

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx

    def describe(self) -> str:
        names = [n for n, on in (("AVX2", self.avx2), ("AVX-512", self.avx512), ("VNNI", self.vnni),
                                 ("AVX512_BF16", self.avx512_bf16), ("AMX", self.amx)) if on]
        return ", ".join(names) or "no AVX2"


@dataclass(frozen=True)
class ActivationDtype:
    """The chosen dtype and why (printed in startup lines and ``--stats``)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """A supported dtype, or None for ``auto``; one-line ``KvslimError`` otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise KvslimError(f"dtype {dtype} is not supported (use one of {', '.join(DTYPE_CHOICES)})")
        return dtype
    if dtype == AUTO:
        return None
    if dtype not in DTYPES:
        raise KvslimError(f"dtype {dtype!r} is not supported (use one of {', '.join(DTYPE_CHOICES)})")
    return DTYPES[dtype]


def _storage(schemes: tuple[QuantScheme, ...]) -> str:
    return " + ".join(dict.fromkeys(s.name for s in schemes)) if schemes else "dense weights"


def choose_activation_dtype(
    requested: str | torch.dtype, schemes: tuple[QuantScheme, ...] = (), device: str | torch.device = "cpu",
    features: CpuFeatures | None = None,
) -> ActivationDtype:
    """Resolve ``requested`` (a dtype, its name, or ``auto``) for a checkpoint whose quantized
    Linears use ``schemes`` (empty: dense) run on ``device``."""
    explicit = parse_dtype(requested)
    if explicit is not None:
        return ActivationDtype(explicit, "requested")
    if torch.device(device).type == "cuda":
        return ActivationDtype(torch.bfloat16, "auto: CUDA")
    features = features or CpuFeatures.detect()
    storage = _storage(schemes)
    if not features.native_bf16:
        return ActivationDtype(torch.float32, f"auto: {storage} on a CPU without native bf16 ({features.describe()})")
    return ActivationDtype(torch.bfloat16, f"auto: {storage} on a CPU with native bf16 ({features.describe()})")
