"""The activation dtype a checkpoint runs with: chosen once, beside the kernel choice (``make_linear``).

``dtype="auto"`` (the default of ``LLM``, ``Engine`` and every command that runs a checkpoint)
picks by the checkpoint's weight storage and the CPU's features:

- CUDA: bfloat16.
- A CPU with native bf16 (AVX512_BF16 or AMX) and weights whose kernels want bf16: bfloat16.
  torch's weight-only INT4/INT8 CPU kernels (``_weight_int4pack_mm_for_cpu``,
  ``_weight_int8pack_mm``) take bf16 activations only (fp32 falls back to dequantize-then-matmul);
  FP8 weight-only and W8A8 are faster in bf16 too. Decode tok/s bf16 / fp32 on a 2-core AVX-512 +
  VNNI + AVX512_BF16 CPU at batch 1 / 8 (``benchmarks/activation_dtype_speed.py``): INT4 6.4x /
  3.7x, INT8 3.2x / 1.9x, FP8 weight-only 1.08x / 1.21x, W8A8 1.20x / 1.29x.
- Everything else on a CPU: float32. Dense weights (0.48x / 1.83x: oneDNN's bf16 GEMV is slower at
  batch 1, and fp32 is the checkpoint's own precision) and FP8_DYNAMIC (0.85x / 1.12x); a CPU
  without native bf16 emulates it and is faster in fp32 for every storage.

An explicit dtype always wins. bf16 activations move logits: the figures are in BENCHMARKS.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *DTYPES)


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


def wants_bf16(scheme: QuantScheme) -> bool:
    """Whether this weight storage runs faster with bf16 activations on a native-bf16 CPU."""
    weight_only = scheme.input_activations is None
    return weight_only or scheme.type == "int"  # INT4/INT8/FP8 weight-only, W8A8; not FP8_DYNAMIC


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
        return ActivationDtype(torch.float32, f"auto: CPU without native bf16 ({features.describe()})")
    if schemes and all(wants_bf16(s) for s in schemes):
        return ActivationDtype(torch.bfloat16, f"auto: {storage} on a CPU with native bf16 ({features.describe()})")
    return ActivationDtype(torch.float32, f"auto: {storage} run fastest in fp32 on this CPU ({features.describe()})")
