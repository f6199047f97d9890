"""Quantization schemes, named as compressed-tensors names its presets.

A ``QuantScheme`` says how the weights of every targeted Linear are stored (and, for FP8_DYNAMIC
and W8A8, which activation quantization a runtime must apply). ``to_config_group()`` is the exact
``config_groups`` entry compressed-tensors / llm-compressor write into ``config.json``.

=================  ======  =====  ========  ======  =========  =============================
name               bits    type   strategy  group   symmetric  on-disk format
=================  ======  =====  ========  ======  =========  =============================
``FP8_DYNAMIC``    8       float  channel   -       yes        ``float-quantized``
``FP8_W8A16``      8       float  channel   -       yes        ``float-quantized`` (weight-only)
``W8A8``           8       int    channel   -       yes        ``int-quantized`` (int8)
``W8A16``          8       int    channel   -       yes        ``pack-quantized`` (4 / int32)
``W4A16``          4       int    group     64      yes        ``pack-quantized`` (8 / int32)
``W4A16_ASYM``     4       int    group     64      no         ``pack-quantized`` + packed zp
=================  ======  =====  ========  ======  =========  =============================

Deviations from compressed-tensors' presets, on purpose: its ``W4A16``/``W8A16`` presets use
group 128, which does not divide the default model's hidden size (576 = 4.5 x 128), so kvslim's
preset constants use group 64 and INT8 is per-channel. ``W8A8`` is compressed-tensors' preset of
that name as is (INT8 per-channel symmetric weights, dynamic per-token symmetric INT8 activations);
like FP8_DYNAMIC it stores the weight unpacked (``int-quantized``: int8 ``weight`` + ``weight_scale``). ``compress quantize --int4`` without
options uses ``default_scheme("int4")``: symmetric, group ``DEFAULT_INT4_GROUP_SIZE`` = 32 (see
below). Any group size that divides every quantized layer's input features can be asked for
explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from foundation.errors import KvslimError

QuantType = Literal["int", "float"]
Strategy = Literal["channel", "group"]

FLOAT_QUANTIZED = "float-quantized"
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"

# The INT4 default: symmetric, because transformers' plain from_pretrained cannot load packed zero
# points (compress.transformers_compat); group 32 over 64 on the calibration dev slice with the
# default pipeline (GPTQ act-order + mse, 16 tuning steps): +6.46% vs +7.75% perplexity
# (wikipedia:eval: +9.42% vs +10.95%); asymmetric g32 stays behind --asymmetric
# (benchmarks/results/int4_default_choice.json).
PRESET_INT4_GROUP_SIZE = 64
DEFAULT_INT4_GROUP_SIZE = 32
DEFAULT_INT4_SYMMETRIC = True


@dataclass(frozen=True)
class ActivationQuant:
    """Activation quantization a runtime applies on the fly (declared, never stored)."""

    num_bits: int
    type: QuantType
    strategy: Literal["token", "tensor"]
    symmetric: bool = True
    dynamic: bool = True

    def describe(self) -> str:
        kind = "FP8" if self.type == "float" else f"INT{self.num_bits}"
        return f"{'dynamic' if self.dynamic else 'static'} per-{self.strategy} {kind} activations"

    def to_config(self) -> dict:
        return {
            "num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
            "group_size": None, "strategy": self.strategy, "dynamic": self.dynamic,
        }


@dataclass(frozen=True)
class QuantScheme:
    """How one Linear's weight is quantized and stored.

    ``group_size`` is ``None`` for the channel strategy (one scale per output row) and the
    number of consecutive input columns sharing a scale for the group strategy.
    """

    name: str
    num_bits: int
    type: QuantType
    strategy: Strategy
    group_size: int | None
    symmetric: bool
    input_activations: ActivationQuant | None = None
    # GPTQ's activation ordering as compressed-tensors records it: "weight" (columns visited by
    # decreasing Hessian diagonal, groups unchanged, no weight_g_idx). None: not used.
    actorder: Literal["weight"] | None = None

    def __post_init__(self) -> None:
        if self.strategy == "group" and not (self.group_size and self.group_size > 0):
            raise KvslimError(f"scheme {self.name}: group strategy needs a positive group size")
        if self.strategy == "channel" and self.group_size is not None:
            raise KvslimError(f"scheme {self.name}: channel strategy takes no group size")
        if self.type == "float" and (self.num_bits != 8 or not self.symmetric):
            raise KvslimError(f"scheme {self.name}: only symmetric 8-bit floats (FP8 E4M3) are supported")
        if self.type == "int" and self.num_bits not in (4, 8):
            raise KvslimError(f"scheme {self.name}: integer weights must be 4 or 8 bits")
        acts = self.input_activations
        if acts is not None and acts.type != self.type:
            raise KvslimError(f"scheme {self.name}: {acts.type} activations with {self.type} weights are not supported")
        if self.type == "int" and acts is not None and not (
            (self.num_bits, self.strategy, self.symmetric) == (8, "channel", True)
            and (acts.num_bits, acts.type, acts.strategy, acts.symmetric, acts.dynamic) == (8, "int", "token", True, True)
        ):
            raise KvslimError(f"scheme {self.name}: integer weights with quantized activations are supported only as "
                              "W8A8 (per-channel symmetric INT8 weights, dynamic per-token symmetric INT8 activations)")

    # --- derived facts ------------------------------------------------------------------------
    @property
    def format(self) -> str:
        """The compressed-tensors compression format of this scheme's Linears (what
        ``infer_module_format`` picks: int weights with quantized activations stay unpacked)."""
        if self.type == "float":
            return FLOAT_QUANTIZED
        return INT_QUANTIZED if self.input_activations is not None else PACK_QUANTIZED

    @property
    def is_packed(self) -> bool:
        return self.format == PACK_QUANTIZED

    @property
    def pack_factor(self) -> int:
        """Quantized values per int32 word (packed formats)."""
        return 32 // self.num_bits

    @property
    def q_min(self) -> float:
        return -448.0 if self.type == "float" else float(-(1 << (self.num_bits - 1)))

    @property
    def q_max(self) -> float:
        return 448.0 if self.type == "float" else float((1 << (self.num_bits - 1)) - 1)

    def describe(self) -> str:
        if self.strategy == "group":
            detail = f"group {self.group_size}"
        else:
            detail = "per-channel"
        sym = "symmetric" if self.symmetric else "asymmetric"
        acts = f", {self.input_activations.describe()}" if self.input_activations else ", weight-only"
        kind = "FP8 E4M3" if self.type == "float" else f"INT{self.num_bits}"
        return f"{self.name} ({kind} {detail} {sym}{acts}; {self.format})"

    def check_input_features(self, in_features: int, layer: str) -> None:
        """Raise if this scheme cannot quantize a Linear with ``in_features`` columns.

        compressed-tensors refuses group quantization when the group does not divide the columns
        (``_process_group``: "tensor column shape must be divisible by the given group_size").
        """
        if self.strategy == "group" and in_features % int(self.group_size) != 0:
            raise KvslimError(
                f"--group-size {self.group_size} does not divide {layer}'s {in_features} input features; "
                f"choose a divisor of {in_features} (e.g. 32 or 64) or --ignore that layer"
            )

    # --- compressed-tensors config ------------------------------------------------------------
    def weights_config(self) -> dict:
        """The ``weights`` entry, as ``QuantizationArgs.model_dump()`` writes it."""
        # compressed-tensors omits unset optional fields (zp_dtype, observer, actorder, ...).
        config = {
            "num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
            "group_size": self.group_size, "strategy": self.strategy, "dynamic": False,
        }
        if self.actorder is not None:
            config["actorder"] = self.actorder
        return config

    def to_config_group(self, targets: tuple[str, ...] = ("Linear",)) -> dict:
        """The ``config_groups`` entry (``QuantizationScheme.model_dump()`` after
        llm-compressor's ``infer_model_format`` has set the group's ``format``)."""
        return {
            "targets": list(targets),
            "weights": self.weights_config(),
            "input_activations": self.input_activations.to_config() if self.input_activations else None,
            "output_activations": None,
            "format": self.format,
        }

    def with_options(self, group_size: int | None = None, symmetric: bool | None = None) -> "QuantScheme":
        """This scheme with an explicit group size and/or symmetry (from the CLI)."""
        scheme = self
        if self.input_activations is not None and self.type == "int" and (
            group_size is not None or symmetric is False
        ):
            raise KvslimError("--w8a8 is per-channel symmetric (compressed-tensors' W8A8 preset); "
                              "--group-size/--asymmetric apply to --int8/--int4")
        if group_size is not None:
            if self.type == "float":
                raise KvslimError("--group-size applies to --int8/--int4; FP8 weights are per-channel")
            if group_size <= 0:
                raise KvslimError(f"--group-size must be positive, got {group_size}")
            scheme = replace(scheme, strategy="group", group_size=group_size)
        if symmetric is not None and symmetric != scheme.symmetric:
            if self.type == "float":
                raise KvslimError("FP8 weights are symmetric only; --asymmetric applies to --int8/--int4")
            scheme = replace(scheme, symmetric=symmetric)
        base = "W8A16" if scheme.num_bits == 8 else "W4A16"
        if scheme.type == "int" and scheme.input_activations is None:
            scheme = replace(scheme, name=base if scheme.symmetric else f"{base}_ASYM")
        return scheme


FP8_TOKEN_DYNAMIC = ActivationQuant(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
INT8_TOKEN_DYNAMIC = ActivationQuant(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)

# Its per-token FP8 activations alone (original weights) cost +0.99% perplexity on the default
# model (held-out calibration text): no weight quantizer takes FP8_DYNAMIC below that; FP8_W8A16
# keeps activations unquantized.
FP8_DYNAMIC = QuantScheme("FP8_DYNAMIC", 8, "float", "channel", None, True, FP8_TOKEN_DYNAMIC)
W8A8 = QuantScheme("W8A8", 8, "int", "channel", None, True, INT8_TOKEN_DYNAMIC)
W8A16 = QuantScheme("W8A16", 8, "int", "channel", None, True)
W4A16 = QuantScheme("W4A16", 4, "int", "group", PRESET_INT4_GROUP_SIZE, True)
W4A16_ASYM = QuantScheme("W4A16_ASYM", 4, "int", "group", PRESET_INT4_GROUP_SIZE, False)
# FP8 weights, activations left in bf16/fp16: vLLM serves it with its FP8 Marlin kernel
# (CompressedTensorsW8A16Fp8, SM80+). Not a compressed-tensors preset name.
FP8_W8A16 = QuantScheme("FP8_W8A16", 8, "float", "channel", None, True)

PRESETS: dict[str, QuantScheme] = {s.name: s for s in (FP8_DYNAMIC, W8A8, W8A16, W4A16, W4A16_ASYM)}


def default_scheme(kind: Literal["fp8", "fp8-weight-only", "w8a8", "int8", "int4"]) -> QuantScheme:
    """The scheme ``compress quantize --fp8/--fp8-weight-only/--w8a8/--int8/--int4`` uses without
    further options."""
    if kind == "fp8":
        return FP8_DYNAMIC
    if kind == "fp8-weight-only":
        return FP8_W8A16
    if kind == "w8a8":
        return W8A8
    if kind == "int8":
        return W8A16
    return W4A16.with_options(group_size=DEFAULT_INT4_GROUP_SIZE, symmetric=DEFAULT_INT4_SYMMETRIC)


def scheme_from_config_group(group: dict) -> QuantScheme:
    """Read a ``config_groups`` entry back (the inverse of ``to_config_group``)."""
    w = group.get("weights") or {}
    acts = group.get("input_activations")
    act = None
    if acts:
        act = ActivationQuant(int(acts["num_bits"]), acts["type"], acts["strategy"],
                              bool(acts.get("symmetric", True)), bool(acts.get("dynamic", True)))
    strategy = w.get("strategy")
    if strategy not in ("channel", "group") or w.get("type") not in ("int", "float"):
        raise KvslimError(f"unsupported weight quantization in config: {w}")
    num_bits, qtype, sym = int(w["num_bits"]), w["type"], bool(w.get("symmetric", True))
    group_size = int(w["group_size"]) if strategy == "group" else None
    if qtype == "float":
        name = "FP8_DYNAMIC" if act else "FP8_W8A16"
    elif act is not None:
        name = f"W{num_bits}A{act.num_bits}"
    else:
        name = f"W{num_bits}A16" + ("" if sym else "_ASYM")
    actorder = w.get("actorder")
    if actorder not in (None, "weight"):
        raise KvslimError(f"unsupported activation ordering in config: actorder={actorder!r}")
    return QuantScheme(name, num_bits, qtype, strategy, group_size, sym, act, actorder)
