"""Would vLLM's quantized-Linear kernels accept a layer? (Nothing here can run vLLM itself.)

The rules restate vLLM's own checks (read in vllm/model_executor/layers/quantization/utils/
``marlin_utils.py`` and ``machete_utils.py``, and the MacheteLinearKernel), for one GPU (no
tensor-parallel split):

- Marlin (GPTQ-Marlin, SM75+): weight types uint4b8 / uint8b128 (symmetric INT4 / INT8),
  uint4 with zero points (asymmetric INT4 only; asymmetric INT8 is not supported), and FP8
  E4M3 weights (weight-only fallback); group size in {channel, 32, 64, 128};
  ``out_features % 64 == 0`` (min_thread_n), ``in_features % 128 == 0`` (min_thread_k) and
  ``in_features % group_size == 0``.
- Machete (Hopper SM90 only): INT4 / INT8 symmetric or with zero points, bf16/fp16
  activations; group size in {channel, 64, 128}; ``in_features % 64 == 0`` and
  ``out_features % 128 == 0``.
- FP8 per-channel weights with dynamic per-token FP8 activations run through an FP8 scaled-mm
  (CUTLASS on SM89+); like ``torch._scaled_mm`` it needs both dimensions to be multiples of 16.
- W8A8 INT8 (per-channel weights, dynamic per-token activations) runs through the INT8 CUTLASS
  scaled-mm (SM75+), whose entry point checks the same 16-byte alignment: ``in_features`` (the
  column-major weight's stride) and ``out_features`` (the output's row stride) multiples of 16.
"""
from __future__ import annotations

from dataclasses import dataclass

from foundation.schemes import QuantScheme

MARLIN_GROUP_SIZES = (None, 32, 64, 128)  # None: per-channel (vLLM's -1)
MARLIN_MIN_THREAD_N = 64
MARLIN_MIN_THREAD_K = 128
MACHETE_GROUP_SIZES = (None, 64, 128)
MACHETE_BLOCK_K, MACHETE_BLOCK_N = 64, 128
FP8_ALIGN = 16


@dataclass(frozen=True)
class KernelVerdict:
    kernel: str
    ok: bool
    reason: str = ""

    def describe(self) -> str:
        return f"{self.kernel}: {'yes' if self.ok else 'no (' + self.reason + ')'}"


def _group(scheme: QuantScheme) -> int | None:
    return scheme.group_size if scheme.strategy == "group" else None


def marlin(scheme: QuantScheme, in_features: int, out_features: int) -> KernelVerdict:
    g = _group(scheme)
    if scheme.type == "int" and not scheme.symmetric and scheme.num_bits != 4:
        return KernelVerdict("Marlin", False, "zero points only for INT4")
    if g not in MARLIN_GROUP_SIZES:
        return KernelVerdict("Marlin", False, f"group size {g} not in 32/64/128/channel")
    problems = []
    if out_features % MARLIN_MIN_THREAD_N:
        problems.append(f"out {out_features} % {MARLIN_MIN_THREAD_N}")
    if in_features % MARLIN_MIN_THREAD_K:
        problems.append(f"in {in_features} % {MARLIN_MIN_THREAD_K}")
    if g is not None and g < in_features and in_features % g:
        problems.append(f"in {in_features} % group {g}")
    return KernelVerdict("Marlin", not problems, ", ".join(problems) + (" != 0" if problems else ""))


def machete(scheme: QuantScheme, in_features: int, out_features: int) -> KernelVerdict:
    if scheme.type != "int":
        return KernelVerdict("Machete", False, "integer weights only")
    g = _group(scheme)
    if g not in MACHETE_GROUP_SIZES:
        return KernelVerdict("Machete", False, f"group size {g} not in 64/128/channel")
    problems = []
    if in_features % MACHETE_BLOCK_K:
        problems.append(f"in {in_features} % {MACHETE_BLOCK_K}")
    if out_features % MACHETE_BLOCK_N:
        problems.append(f"out {out_features} % {MACHETE_BLOCK_N}")
    return KernelVerdict("Machete", not problems, ", ".join(problems) + (" != 0" if problems else ""))


def fp8_scaled_mm(scheme: QuantScheme, in_features: int, out_features: int) -> KernelVerdict:
    if scheme.type != "float" or scheme.input_activations is None:
        return KernelVerdict("FP8 scaled_mm", False, "needs FP8 weights and FP8 activations")
    return _aligned("FP8 scaled_mm", in_features, out_features)


def int8_scaled_mm(scheme: QuantScheme, in_features: int, out_features: int) -> KernelVerdict:
    if scheme.type != "int" or scheme.input_activations is None:
        return KernelVerdict("INT8 scaled_mm", False, "needs INT8 weights and INT8 activations")
    return _aligned("INT8 scaled_mm", in_features, out_features)


def _aligned(kernel: str, in_features: int, out_features: int) -> KernelVerdict:
    problems = [f"{n} {v} % {FP8_ALIGN}" for n, v in (("in", in_features), ("out", out_features)) if v % FP8_ALIGN]
    return KernelVerdict(kernel, not problems, ", ".join(problems) + (" != 0" if problems else ""))


def kernel_verdicts(scheme: QuantScheme, in_features: int, out_features: int) -> tuple[KernelVerdict, ...]:
    """The kernels that could serve this scheme, each with its verdict for the layer shape."""
    if scheme.type == "int" and scheme.input_activations is not None:
        return (int8_scaled_mm(scheme, in_features, out_features),)
    if scheme.type == "float":
        return (fp8_scaled_mm(scheme, in_features, out_features), marlin(scheme, in_features, out_features))
    return (marlin(scheme, in_features, out_features), machete(scheme, in_features, out_features))
