"""A bitsandbytes checkpoint's ``quantization_config`` (NF4 / FP4 4-bit, LLM.int8): read, described.

kvslim writes these through transformers (``compress quantize --nf4 | --int8-bnb``) for users who
load with transformers + bitsandbytes or vLLM (``--quantization bitsandbytes``); its own runtime
serves compressed-tensors checkpoints, and says so in one line when handed one of these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from foundation.tensor_shapes import (
    FLOAT,
    INT8,
    Dtypes,
    ModelShapes,
    TensorRule,
    expected_tensors,
    layer_linears,
    no_quantization,
)

QUANT_METHOD = "bitsandbytes"
BnbKind = Literal["nf4", "fp4", "int8"]
# bitsandbytes' 4-bit blocksize (transformers does not expose it): one absmax per 64 weights.
BLOCKSIZE_4BIT = 64


@dataclass(frozen=True)
class BnbScheme:
    kind: BnbKind
    compute_dtype: str  # 4-bit: the dtype Linears compute in
    double_quant: bool  # 4-bit: absmax quantized again (8-bit, blocks of 256)
    skip_modules: tuple[str, ...]
    threshold: float  # LLM.int8: activation outlier threshold (columns above it run in fp16)

    @classmethod
    def of_model_config(cls, config: dict) -> "BnbScheme | None":
        """The scheme of a config.json dict, or None when it is not a bitsandbytes checkpoint."""
        qc = config.get("quantization_config") or {}
        if qc.get("quant_method") != QUANT_METHOD:
            return None
        four = bool(qc.get("load_in_4bit") or qc.get("_load_in_4bit"))
        return cls(
            kind=qc.get("bnb_4bit_quant_type", "fp4") if four else "int8",
            compute_dtype=str(qc.get("bnb_4bit_compute_dtype") or "float32"),
            double_quant=bool(qc.get("bnb_4bit_use_double_quant", False)),
            skip_modules=tuple(qc.get("llm_int8_skip_modules") or ()),
            threshold=float(qc.get("llm_int8_threshold", 6.0)),
        )

    @property
    def bits(self) -> int:
        return 8 if self.kind == "int8" else 4

    def describe(self) -> str:
        if self.kind == "int8":
            return (f"bitsandbytes LLM.int8 (INT8 per-row weights; activation columns above {self.threshold:g} "
                    "in fp16)")
        double = ", double-quantized absmax" if self.double_quant else ""
        return (f"bitsandbytes {self.kind.upper()} (4-bit, blocks of {BLOCKSIZE_4BIT}{double}), "
                f"compute {self.compute_dtype}")


def bnb_tensor_rules(shapes: ModelShapes, scheme: BnbScheme) -> dict[str, TensorRule]:
    """Every tensor a bitsandbytes checkpoint of ``shapes`` needs: the dense model's, each Linear's
    weight replaced by bitsandbytes' own tensors (4-bit: packed codes ``[ceil(out * in / 2), 1]``
    uint8, one fp32 absmax per 64 weights, the 16-entry code map, the serialized quant state;
    LLM.int8: ``[out, in]`` int8 codes and one fp32 scale per row). Double-quantized absmax
    tensors are not checked (kvslim does not write them)."""
    uint8 = Dtypes("uint8", ("U8",))
    rules = expected_tensors(shapes, no_quantization)
    for i in range(shapes.attention.num_layers):
        for linear in layer_linears(shapes, i).values():
            m, out, cols = linear.module, linear.out_features, linear.in_features
            what = f"{scheme.kind.upper()} Linear {linear.dims}"
            del rules[f"{m}.weight"]
            if scheme.kind == "int8":
                rules[f"{m}.weight"] = TensorRule((out, cols), INT8, what)
                rules[f"{m}.SCB"] = TensorRule((out,), FLOAT, f"row scales of {what}")
                rules[f"{m}.weight_format"] = TensorRule((), uint8, f"layout tag of {what}", optional=True)
                continue
            n = out * cols
            rules[f"{m}.weight"] = TensorRule(((n + 1) // 2, 1), uint8, f"packed 4-bit codes of {what}")
            state = f"{m}.weight.quant_state.bitsandbytes__{scheme.kind}"
            rules[state] = TensorRule(None, uint8, f"quant state of {what}")
            if not scheme.double_quant:
                rules[f"{m}.weight.absmax"] = TensorRule((-(-n // BLOCKSIZE_4BIT),), FLOAT, f"block absmax of {what}")
                rules[f"{m}.weight.quant_map"] = TensorRule((16,), FLOAT, f"code map of {what}")
    return rules
