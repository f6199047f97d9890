"""What `compress quantize` is asked for, as its flags say it (torch-free: the CLI's help reads the
defaults). ``None`` is a flag left unset: some flags are refused unless another asks for them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from foundation.calibration import CalibrationSpec
from foundation.texts import DEFAULT_CALIB

QuantKind = Literal["fp8", "fp8-weight-only", "w8a8", "int8", "int4", "nf4", "int8-bnb"]
# Kinds written by bitsandbytes through transformers (compress.bnb_quantize), not compressed-tensors.
BNB_KINDS = {"nf4": "nf4", "int8-bnb": "int8"}
Method = Literal["rtn", "gptq"]
Observer = Literal["minmax", "mse"]

DEFAULT_IGNORE = ("lm_head",)
DEFAULT_CALIB_WINDOWS = 64
DEFAULT_CALIB_SEQ_LEN = 512


@dataclass(frozen=True)
class QuantizeOptions:
    """One `compress quantize` request, before anything is opened or checked."""

    model: str  # checkpoint directory, .gguf file or known name
    output: str
    kind: QuantKind
    group_size: int | None = None
    symmetric: bool | None = None
    ignore: tuple[str, ...] | None = None  # None: DEFAULT_IGNORE
    dtype: str | None = None  # bfloat16 or float16; None: the source's own
    method: Method = "rtn"
    act_order: bool | None = None  # GPTQ; None: the scheme's default
    observer: Observer | None = None  # GPTQ; None: the scheme's default
    dampening: float | None = None  # GPTQ; None: the default
    calib: str | None = None  # calibration text; None: DEFAULT_CALIB
    num_calib_samples: int | None = None
    calib_seq_len: int | None = None
    tune_scales_steps: int | None = None
    smooth: float | None = None  # SmoothQuant's alpha; None: no smoothing
    kv_cache_fp8: bool = False
    lm_head: str | None = None  # "int8" | "int4" | "bf16": the output projection's own storage
    force: bool = False
    progress: bool = True

    @property
    def calibrates(self) -> bool:
        """Whether any pass reads calibration text."""
        return (self.method == "gptq" or self.kv_cache_fp8 or self.smooth is not None
                or self.tune_scales_steps is not None)

    @property
    def compressed_tensors_flags(self) -> list[str]:
        """The flags given that only compressed-tensors quantization takes."""
        return [f for f, v in (("--group-size", self.group_size), ("--symmetric/--asymmetric", self.symmetric),
                               ("--ignore", self.ignore), ("--method gptq", self.method == "gptq" or None),
                               ("--tune-scales-steps", self.tune_scales_steps), ("--smooth", self.smooth),
                               ("--kv-cache-fp8", self.kv_cache_fp8 or None), ("--lm-head", self.lm_head))
                if v is not None] + self.gptq_flags + self.calibration_flags

    @property
    def gptq_flags(self) -> list[str]:
        """The GPTQ-only flags given."""
        return [f for f, v in (("--act-order", self.act_order), ("--dampening", self.dampening),
                               ("--observer", self.observer)) if v is not None]

    @property
    def calibration_flags(self) -> list[str]:
        """The calibration flags given."""
        return [f for f, v in (("--calib", self.calib), ("--num-calib-samples", self.num_calib_samples),
                               ("--calib-seq-len", self.calib_seq_len)) if v is not None]

    def calibration(self) -> CalibrationSpec:
        """The calibration text and windows asked for, defaults filled in."""
        return CalibrationSpec(
            source=self.calib or DEFAULT_CALIB,
            num_samples=DEFAULT_CALIB_WINDOWS if self.num_calib_samples is None else self.num_calib_samples,
            seq_len=DEFAULT_CALIB_SEQ_LEN if self.calib_seq_len is None else self.calib_seq_len,
        )
