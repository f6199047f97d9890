"""ModelSpec: everything the generic decoder needs to know, read from a checkpoint's config.json.

One frozen description covers Llama, Qwen2, Qwen3, Mistral and Gemma 3 (text). The attention
part (heads, per-layer window, KV source) is ``foundation.attention_layout.AttentionLayout``; the
rest are the family differences the decoder switches on (biases, q/k norms, Gemma's norm offset,
embedding scale, sandwich norms, per-layer rope, logit softcaps) and the declared weight
quantization (``QuantSpec``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from foundation.architecture import model_type_of
from foundation.attention_layout import FULL, SLIDING, AttentionLayout
from foundation.errors import CheckpointError, KvslimError
from foundation.quant_spec import QuantSpec
from foundation.tensor_shapes import ModelShapes
from runtime.attention.backend import AttentionParams
from runtime.attention.key_rope import KeyRope

# Activations the MLP supports (HF names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Rope types whose frequencies do not depend on the sequence length (transformers' names).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: type, base and the type's extra parameters (``rope_parameters``)."""

    rope_type: str
    theta: float
    params: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.params}
        out.update(rope_type=self.rope_type, rope_theta=self.theta)
        return out


def check_servable(quant: QuantSpec) -> QuantSpec:
    """``quant`` if the runtime can serve its activation quantization; raise ``KvslimError`` otherwise."""
    for group in quant.groups:
        acts = group.scheme.input_activations
        if acts is None:
            continue
        where = f"quantization group targeting {', '.join(group.targets)}"
        if not acts.dynamic:
            raise KvslimError(f"{where}: static activation scales are not supported")
        if (acts.type, acts.strategy) not in (("float", "token"), ("int", "token")) or acts.num_bits != 8:
            raise KvslimError(f"{where}: only dynamic per-token FP8 or INT8 activations are supported")
    return quant


@dataclass(frozen=True)
class ModelSpec(ModelShapes):
    """``ModelShapes`` (dimensions and tensor set, shared with compress and inspect) plus what the
    decoder switches on and the declared quantization; built once per load from config.json."""

    model_type: str
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    norm_offset: float  # Gemma: norms scale by (1 + weight)
    embed_scale: float | None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float
    rope: tuple[RopeSpec, ...]  # one per layer
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    quant: QuantSpec | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, in that order

    @property
    def num_layers(self) -> int:
        return self.attention.num_layers

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    def num_kv_heads(self, layer: int) -> int:
        return self.attention.layers[layer].num_kv_heads

    def attention_params(self, entry: int) -> AttentionParams:
        """The backend's constants for attention entry ``entry`` (a layer, or a layer's streaming
        heads: ``AttentionLayout.entries``)."""
        la = self.attention.entries[entry]
        layer = self.attention.entry_layers[entry]
        rope = KeyRope.of(self.rope[layer], self.head_dim, self.max_position_embeddings)
        return AttentionParams(self.attn_scale, la.window, la.kv_source, self.attn_logit_softcap, la.sinks, rope)

    def all_attention_params(self) -> list[AttentionParams]:
        """``attention_params`` of every attention entry, in entry order (what a backend takes)."""
        return [self.attention_params(e) for e in range(len(self.attention.entries))]

    @classmethod
    def from_config(cls, config: dict, generation_config: dict | None = None) -> "ModelSpec":
        """Read a config.json dict (and generation_config.json's, for its EOS ids); raise
        ``KvslimError`` for anything the runtime cannot serve."""
        model_type = model_type_of(config)
        gemma = model_type == "gemma3_text"
        config = _with_layer_types(config, model_type)
        if config.get("use_bidirectional_attention"):
            raise KvslimError("bidirectional attention (use_bidirectional_attention) is not supported")
        try:
            layout = AttentionLayout.from_config(config)
            shapes = ModelShapes.from_config(config, layout)
            hidden = shapes.hidden_size
            act = config.get("hidden_activation") if gemma else config.get("hidden_act", "silu")
            if act not in ACTIVATIONS:
                raise KvslimError(f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
            if layout.num_heads % layout.num_kv_heads:
                raise KvslimError(
                    f"num_attention_heads={layout.num_heads} is not a multiple of num_key_value_heads={layout.num_kv_heads}"
                )
            eos_ids = _token_ids(config.get("eos_token_id"))
            extra_eos = _token_ids((generation_config or {}).get("eos_token_id"))
            eos_ids += tuple(e for e in dict.fromkeys(extra_eos) if e not in eos_ids)
            quant = QuantSpec.of_model_config(config)
            scale_base = float(config.get("query_pre_attn_scalar") or layout.head_dim) if gemma else float(layout.head_dim)
            return cls(
                **{f.name: getattr(shapes, f.name) for f in fields(ModelShapes)},
                model_type=model_type,
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                hidden_act=str(act),
                max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
                norm_offset=1.0 if gemma else 0.0,
                embed_scale=hidden**0.5 if gemma else None,
                attn_scale=scale_base**-0.5,
                rope=_rope_per_layer(config, model_type),
                # transformers' Gemma 3 attention ignores attn_logit_softcapping; so does the runtime.
                attn_logit_softcap=None,
                final_logit_softcap=_opt_float(config.get("final_logit_softcapping")) if gemma else None,
                quant=check_servable(quant) if quant else None,
                bos_token_id=config.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"config.json: missing or malformed key {e}") from None


def _token_ids(value) -> tuple[int, ...]:
    """An ``eos_token_id`` entry (an id, a list of ids or None) as a tuple."""
    return tuple(int(e) for e in (value if isinstance(value, list) else [] if value is None else [value]))


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


def _with_layer_types(config: dict, model_type: str) -> dict:
    """Gemma 3 configs may give only ``sliding_window_pattern``; spell out ``layer_types``."""
    if model_type != "gemma3_text" or config.get("layer_types") is not None:
        return config
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
    n = int(config["num_hidden_layers"])
    types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return {**config, "layer_types": types}


def _rope_spec(params: dict, default_theta: float, where: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise KvslimError(f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(STATIC_ROPE_TYPES)})")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise KvslimError(f"{where}: partial rotary embeddings are not supported")
    theta = float(params.get("rope_theta", default_theta))
    extra = tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items() if k not in ("rope_type", "type", "rope_theta"))
    )
    return RopeSpec(rope_type, theta, extra)


def _rope_per_layer(config: dict, model_type: str) -> tuple[RopeSpec, ...]:
    """Rope per layer from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
    n = int(config["num_hidden_layers"])
    params = config.get("rope_parameters")
    if model_type == "gemma3_text":
        types = config["layer_types"]
        if params is None or FULL not in params:
            full = dict(config.get("rope_scaling") or {})
            full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
            local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
            params = {FULL: full, SLIDING: local}
        by_type = {t: _rope_spec(params[t] or {}, 10_000.0, f"rope_parameters[{t}]") for t in set(types)}
        return tuple(by_type[t] for t in types)
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10_000.0))
    spec = _rope_spec(params, 10_000.0, "rope_parameters")
    return (spec,) * n
