"""The tensors a checkpoint must hold, with the shapes and dtypes its config.json implies.

One table (``expected_tensors``) serves every reader that must refuse a damaged checkpoint with
one line instead of a traceback on first use: the runtime loader, ``compress quantize`` (its
source) and ``compress inspect``. Shapes come from the safetensors headers; the only tensors read
are the two-value ``weight_shape`` of packed Linears.

Layouts (names relative to a Linear ``[out, in]``; see ``foundation.primitives``): ``weight``
``[out, in]`` (float, FP8 E4M3, or int8 for W8A8); packed: ``weight_packed`` ``[out, ceil(in /
pack)]`` int32, ``weight_shape`` = ``[out, in]``, ``weight_zero_point`` (asymmetric) ``[ceil(out
/ pack), groups]`` int32; ``weight_scale`` ``[out, groups]`` (``groups`` = 1 per channel, ``in /
group_size`` per group); ``weight_g_idx`` (act-order, optional) ``[in]``; ``bias`` ``[out]``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Container

from foundation.architecture import (
    ATTENTION_PROJECTIONS,
    KV_PROJECTIONS,
    MLP_PROJECTIONS,
    model_type_of,
)
from foundation.attention_layout import AttentionLayout
from foundation.checkpoint import Checkpoint
from foundation.errors import CheckpointError
from foundation.quant_spec import kv_cache_scheme_of
from foundation.schemes import QuantScheme

SchemeFor = Callable[[str], QuantScheme | None]  # a Linear module name -> its declared scheme


@dataclass(frozen=True)
class Dtypes:
    """The safetensors dtypes a tensor may have, and what to call several of them in an error."""

    description: str
    allowed: tuple[str, ...]


FLOAT = Dtypes("a floating-point dtype", ("F32", "BF16", "F16", "F64"))
FP8 = Dtypes("FP8 E4M3", ("F8_E4M3",))
INT8 = Dtypes("int8", ("I8",))
INT32 = Dtypes("int32", ("I32",))
INDEX = Dtypes("an integer dtype", ("I64", "I32"))

# Tensors a checkpoint may carry that no reader needs.
IGNORABLE = (
    re.compile(r".*\.rotary_emb\.inv_freq$"),
    re.compile(r".*\.self_attn\.[kv]_scale$"),  # KV-cache scales: read by the cache, not the weights
)
_READER_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")


def no_quantization(module: str) -> None:
    """``SchemeFor`` of an unquantized checkpoint: every Linear is floating point."""
    return None


@dataclass(frozen=True)
class ModelShapes:
    """The dimensions and per-family tensor set of a decoder (Llama, Qwen2/3, Mistral, Gemma 3)."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    attention: AttentionLayout
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama/Qwen3/Gemma with attention_bias)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    sandwich_norm: bool  # Gemma: pre/post-feedforward norms

    @classmethod
    def from_config(cls, config: dict, attention: AttentionLayout | None = None) -> "ModelShapes":
        """Read a config.json dict; ``attention``: its layout, when the caller has read it already."""
        model_type = model_type_of(config)
        gemma = model_type == "gemma3_text"
        try:
            attention_bias = bool(config.get("attention_bias", False))
            return cls(
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                attention=attention or AttentionLayout.from_config(config),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
                qkv_bias=True if model_type == "qwen2" else attention_bias and model_type != "mistral",
                o_bias=attention_bias and model_type in ("llama", "qwen3", "gemma3_text"),
                mlp_bias=bool(config.get("mlp_bias", False)) and model_type == "llama",
                qk_norm=model_type in ("qwen3", "gemma3_text"),
                sandwich_norm=gemma,
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"config.json: missing or malformed key {e}") from None

    def owns_kv(self, layer: int) -> bool:
        """False for a KV-sharing reader: it has no k/v projections and no k_norm."""
        return self.attention.layers[layer].kv_source == layer


@dataclass(frozen=True)
class LinearShape:
    """One Linear of the model: module name, ``[out, in]``, bias, and the config keys behind them."""

    module: str
    out_features: int
    in_features: int
    bias: bool
    dims: str  # e.g. "hidden_size -> intermediate_size"


@dataclass(frozen=True)
class TensorRule:
    """What one tensor must be: its shape and dtype, and where they come from (for the message)."""

    shape: tuple[int, ...] | None  # None: any shape (an opaque serialized blob)
    dtypes: Dtypes
    origin: str
    optional: bool = False
    contents: tuple[int, ...] | None = None  # the values of a tiny tensor (``weight_shape``)


def layer_linears(shapes: ModelShapes, i: int) -> dict[str, LinearShape]:
    """The Linears of decoder layer ``i``, by projection name (``ATTENTION_PROJECTIONS`` then
    ``MLP_PROJECTIONS``; a KV reader has no ``KV_PROJECTIONS``)."""
    p = f"model.layers.{i}."
    hidden, inter = shapes.hidden_size, shapes.intermediate_size
    q_out = shapes.attention.num_heads * shapes.attention.head_dim
    kv_out = shapes.attention.layers[i].num_kv_heads * shapes.attention.head_dim
    q_dims = "num_attention_heads x head_dim"
    kv = (kv_out, hidden, shapes.qkv_bias, "hidden_size -> num_key_value_heads x head_dim")
    dims = {
        "q_proj": (q_out, hidden, shapes.qkv_bias, f"hidden_size -> {q_dims}"),
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": (hidden, q_out, shapes.o_bias, f"{q_dims} -> hidden_size"),
        "gate_proj": (inter, hidden, shapes.mlp_bias, "hidden_size -> intermediate_size"),
        "up_proj": (inter, hidden, shapes.mlp_bias, "hidden_size -> intermediate_size"),
        "down_proj": (hidden, inter, shapes.mlp_bias, "intermediate_size -> hidden_size"),
    }
    names = [n for n in ATTENTION_PROJECTIONS if shapes.owns_kv(i) or n not in KV_PROJECTIONS]
    modules = [(n, f"{p}self_attn.{n}") for n in names] + [(n, f"{p}mlp.{n}") for n in MLP_PROJECTIONS]
    return {n: LinearShape(module, *dims[n]) for n, module in modules}


def linear_rules(linear: LinearShape, scheme: QuantScheme | None) -> dict[str, TensorRule]:
    """The tensors of one Linear (full names) stored as ``scheme`` declares (``None``: dense)."""
    out, cols, m = linear.out_features, linear.in_features, linear.module
    what = f"Linear {linear.dims}"
    rules: dict[str, TensorRule] = {}
    if scheme is None:
        rules[f"{m}.weight"] = TensorRule((out, cols), FLOAT, what)
    else:
        what = f"{scheme.name} {what}"
        groups = 1
        if scheme.strategy == "group":
            if cols % int(scheme.group_size):
                raise CheckpointError(f"{m}: group size {scheme.group_size} of scheme {scheme.name} does not "
                                      f"divide its {cols} input features ({linear.dims})")
            groups = cols // int(scheme.group_size)
        if scheme.is_packed:
            rules[f"{m}.weight_packed"] = TensorRule((out, math.ceil(cols / scheme.pack_factor)), INT32,
                                                     f"{what}, {scheme.pack_factor} values per int32")
            rules[f"{m}.weight_shape"] = TensorRule((2,), INDEX, f"[out, in] of {what}", contents=(out, cols))
            if not scheme.symmetric:
                rules[f"{m}.weight_zero_point"] = TensorRule((math.ceil(out / scheme.pack_factor), groups), INT32,
                                                             f"packed zero points of {what}")
        else:
            rules[f"{m}.weight"] = TensorRule((out, cols), FP8 if scheme.type == "float" else INT8, what)
        rules[f"{m}.weight_scale"] = TensorRule((out, groups), FLOAT, f"scales of {what}")
        rules[f"{m}.weight_g_idx"] = TensorRule((cols,), INDEX, f"act-order groups of {what}", optional=True)
    if linear.bias:
        rules[f"{m}.bias"] = TensorRule((out,), FLOAT, f"bias of {what}")
    return rules


def kv_scale_rules(shapes: ModelShapes, kv_cache_scheme: dict | None) -> dict[str, TensorRule]:
    """The calibrated ``self_attn.k_scale`` / ``v_scale`` of every cache-owning layer, which a
    static ``quantization_config.kv_cache_scheme`` promises (vLLM reads them; a dynamic scheme
    or none needs no tensors)."""
    if not kv_cache_scheme or kv_cache_scheme.get("dynamic", False):
        return {}
    return {
        f"model.layers.{i}.self_attn.{kind}": TensorRule((1,), FLOAT, "calibrated KV-cache scale of kv_cache_scheme")
        for i in range(shapes.attention.num_layers) if shapes.owns_kv(i) for kind in ("k_scale", "v_scale")
    }


def expected_tensors(shapes: ModelShapes, scheme_for: SchemeFor, kv_cache_scheme: dict | None = None
                     ) -> dict[str, TensorRule]:
    """Every tensor the model needs, in model order, given each Linear's declared scheme and the
    KV-cache scheme (``quantization_config.kv_cache_scheme``)."""
    hidden, head_dim = shapes.hidden_size, shapes.attention.head_dim
    embedding = TensorRule((shapes.vocab_size, hidden), FLOAT, "embedding vocab_size x hidden_size")
    rules = {"model.embed_tokens.weight": embedding}
    norms = ["input_layernorm", "post_attention_layernorm"]
    if shapes.sandwich_norm:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(shapes.attention.num_layers):
        for linear in layer_linears(shapes, i).values():
            rules.update(linear_rules(linear, scheme_for(linear.module)))
        p = f"model.layers.{i}."
        for norm in norms:
            rules[f"{p}{norm}.weight"] = TensorRule((hidden,), FLOAT, "norm over hidden_size")
        if shapes.qk_norm:
            rules[f"{p}self_attn.q_norm.weight"] = TensorRule((head_dim,), FLOAT, "norm over head_dim")
            if shapes.owns_kv(i):
                rules[f"{p}self_attn.k_norm.weight"] = TensorRule((head_dim,), FLOAT, "norm over head_dim")
    rules["model.norm.weight"] = TensorRule((hidden,), FLOAT, "norm over hidden_size")
    if not shapes.tie_word_embeddings:
        lm_head = LinearShape("lm_head", shapes.vocab_size, hidden, False, "hidden_size -> vocab_size")
        rules.update(linear_rules(lm_head, scheme_for("lm_head")))
    rules.update(kv_scale_rules(shapes, kv_cache_scheme))
    return rules


def unused_by_design(name: str, shapes: ModelShapes) -> bool:
    """KV-cache scales, rotary buffers, a tied model's redundant ``lm_head.weight``, and a KV
    reader's own k/v projections and k_norm (it uses its source layer's K/V; transformers
    ignores them too)."""
    if any(p.match(name) for p in IGNORABLE):
        return True
    if name == "lm_head.weight" and shapes.tie_word_embeddings:
        return True
    m = _READER_TENSOR.match(name)
    return m is not None and not shapes.owns_kv(int(m.group(1)))


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _fmt_dtypes(dtypes: Dtypes) -> str:
    if len(dtypes.allowed) == 1:
        return dtypes.allowed[0]
    return f"{dtypes.description}: {', '.join(dtypes.allowed[:-1])} or {dtypes.allowed[-1]}"


def tensor_problems(ckpt: Checkpoint, rules: dict[str, TensorRule]) -> list[str]:
    """One line per tensor of ``rules`` that is missing, of the wrong dtype, shape or contents."""
    problems = []
    for name, rule in rules.items():
        if not ckpt.has(name):
            if not rule.optional:
                problems.append(f"missing tensor {name}")
            continue
        dtype, shape = ckpt.headers[name]
        if dtype not in rule.dtypes.allowed:
            problems.append(f"{name} has dtype {dtype}, expected {_fmt_dtypes(rule.dtypes)} ({rule.origin})")
        elif rule.shape is not None and shape != rule.shape:
            problems.append(f"{name} has shape {_fmt(shape)}, expected {_fmt(rule.shape)} ({rule.origin})")
        elif rule.contents is not None:
            values = tuple(int(v) for v in ckpt.get(name).tolist())
            if values != rule.contents:
                problems.append(f"{name} holds {_fmt(values)}, expected {_fmt(rule.contents)} ({rule.origin})")
    return problems


def check_tensors(ckpt: Checkpoint, rules: dict[str, TensorRule]) -> None:
    """Raise ``CheckpointError`` (one line: the first problem, and how many more) unless every
    tensor of ``rules`` is present, typed and shaped as it says."""
    problems = tensor_problems(ckpt, rules)
    if problems:
        n = len(problems) - 1
        more = f" (and {n} more problem{'s' if n > 1 else ''})" if n else ""
        raise CheckpointError(f"{ckpt.path}: {problems[0]}{more}")


def not_understood(ckpt: Checkpoint, understood: Container[str], shapes: ModelShapes) -> list[str]:
    """The checkpoint's tensors that are neither in ``understood`` nor unused by design, sorted."""
    return sorted(n for n in ckpt.names() if n not in understood and not unused_by_design(n, shapes))


def check_understood(ckpt: Checkpoint, understood: Container[str], shapes: ModelShapes) -> None:
    """Raise ``CheckpointError`` naming the checkpoint's tensors that are neither in
    ``understood`` nor unused by design: a reader that skipped them would misread the model."""
    left = not_understood(ckpt, understood, shapes)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise CheckpointError(f"{ckpt.path}: tensors the runtime does not understand: {', '.join(left[:3])}{more}")


def check_checkpoint(ckpt: Checkpoint, shapes: ModelShapes, scheme_for: SchemeFor) -> list[str]:
    """Raise unless every tensor the config implies is there with its dtype and shape; return the
    checkpoint's other tensors that the runtime would not understand (the caller decides)."""
    rules = expected_tensors(shapes, scheme_for, kv_cache_scheme_of(ckpt.config))
    check_tensors(ckpt, rules)
    return not_understood(ckpt, rules, shapes)
