"""SmoothQuant: move activation outliers into the weights before activation quantization.

Per-token INT8 / FP8 activation quantization spends its range on a few outlier channels. For
every site where a Linear's input is produced by something linear per channel (an RMSNorm's
weight, or the rows of the previous Linear), the input channel ``j`` is divided by ``s_j`` there
and the Linear's input column ``j`` is multiplied by it, with
``s = amax(X)^alpha / amax(W)^(1 - alpha)`` (Xiao et al., 2023). The model computes the same
function (checked to fp32 rounding by the tests); only what is quantized changes. Sites per layer:
the attention norm -> q/k/v, the MLP norm -> gate/up, up_proj's rows -> down_proj, and v_proj's
rows -> o_proj (per KV-head channel; skipped where layers share KV, as other layers read those V).

The result is an ordinary checkpoint (norms and weights changed), so a smoothed W8A8 checkpoint is
the same compressed-tensors format vLLM loads. ``SmoothedCheckpoint`` applies the factors as each
tensor is read: the quantization driver streams it like any source.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from compress.smoothing_spec import SmoothingSpec
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError

_CLAMP = 1e-5  # the SmoothQuant reference's floor for both maxima and the factors
# Normalization layers whose weight multiplies as (1 + w) rather than w.
_OFFSET_NORM_TYPES = ("gemma3_text",)
_MLP_NORM = {"gemma3_text": "pre_feedforward_layernorm"}  # default: post_attention_layernorm


@dataclass(frozen=True)
class Site:
    """Where one factor vector ``s`` applies: divides ``source`` (a norm weight, or the output rows
    of ``source``'s Linear), multiplies the input columns of ``linears``. ``kv_groups``: each source
    channel feeds that many consecutive column blocks of the linears' inputs (GQA's v -> o)."""

    source: str  # module name
    kind: Literal["norm", "offset_norm", "rows"]
    linears: tuple[str, ...]
    kv_groups: int = 1


def smoothing_sites(ckpt: Checkpoint) -> list[Site]:
    """Every smoothing site of ``ckpt``'s decoder layers, in layer order."""
    cfg = ckpt.config
    model_type = cfg.get("model_type")
    norm_kind = "offset_norm" if model_type in _OFFSET_NORM_TYPES else "norm"
    mlp_norm = _MLP_NORM.get(model_type, "post_attention_layernorm")
    sources = cfg.get("kv_source_layers")
    shares_kv = sources is not None and list(sources) != list(range(len(sources)))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    prefix = next((n.split(".layers.")[0] for n in ckpt.names() if ".layers." in n), "model")
    has = lambda module: ckpt.has(f"{module}.weight")  # noqa: E731
    sites: list[Site] = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        qkv = tuple(f"{attn}.{x}_proj" for x in "qkv" if has(f"{attn}.{x}_proj"))
        candidates = [
            Site(f"{p}.input_layernorm", norm_kind, qkv),
            Site(f"{p}.{mlp_norm}", norm_kind, (f"{mlp}.gate_proj", f"{mlp}.up_proj")),
            Site(f"{mlp}.up_proj", "rows", (f"{mlp}.down_proj",)),
        ]
        if not shares_kv:
            candidates.append(Site(f"{attn}.v_proj", "rows", (f"{attn}.o_proj",), heads // kv_heads))
        for site in candidates:
            if site.linears and has(site.source) and all(has(m) for m in site.linears):
                sites.append(site)
    return sites


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _sites_or_refuse(ckpt: Checkpoint) -> list[Site]:
    sites = smoothing_sites(ckpt)
    if not sites:
        raise KvslimError(f"{ckpt.path}: no smoothing site found (no norms feeding projections)")
    return sites


def _column_amax(ckpt: Checkpoint, linears: tuple[str, ...]) -> torch.Tensor:
    return torch.stack([ckpt.get(f"{m}.weight").float().abs().amax(0) for m in linears]).amax(0)


def _per_source(columns: torch.Tensor, kv_groups: int, head_dim: int) -> torch.Tensor:
    """Reduce per-input-column values to per-source-channel maxima (identity unless GQA v -> o)."""
    if kv_groups == 1:
        return columns
    return columns.view(-1, kv_groups, head_dim).amax(1).flatten()


def _to_columns(s: torch.Tensor, kv_groups: int, head_dim: int) -> torch.Tensor:
    if kv_groups == 1:
        return s
    return s.view(-1, 1, head_dim).expand(-1, kv_groups, -1).flatten()


def smoothing_factors(ckpt: Checkpoint, sites: list[Site], input_amax: dict[str, torch.Tensor],
                      alpha: float) -> dict[Site, torch.Tensor]:
    """``s`` per site (per source channel) from the Linears' input maxima and original weights."""
    head_dim = _head_dim(ckpt.config)
    factors = {}
    for site in sites:
        missing = [m for m in site.linears if m not in input_amax]
        if missing:
            raise KvslimError(f"no calibration inputs reached {missing[0]}")
        act = torch.stack([input_amax[m] for m in site.linears]).amax(0)
        act = _per_source(act, site.kv_groups, head_dim).clamp_min(_CLAMP)
        weight = _per_source(_column_amax(ckpt, site.linears), site.kv_groups, head_dim).clamp_min(_CLAMP)
        factors[site] = (act.pow(alpha) / weight.pow(1.0 - alpha)).clamp_min(_CLAMP)
    return factors


@dataclass
class SmoothedCheckpoint(Checkpoint):
    """A source checkpoint read with smoothing applied: tensors come out transformed, in their dtype."""

    ops: dict[str, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)

    @classmethod
    def wrap(cls, ckpt: Checkpoint, factors: dict[Site, torch.Tensor]) -> "SmoothedCheckpoint":
        head_dim = _head_dim(ckpt.config)
        ops: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for site, s in factors.items():
            if site.kind == "rows":
                ops.setdefault(f"{site.source}.weight", []).append(("row_div", s))
                if ckpt.has(f"{site.source}.bias"):
                    ops.setdefault(f"{site.source}.bias", []).append(("row_div", s))
            else:
                ops.setdefault(f"{site.source}.weight", []).append((site.kind, s))
            columns = _to_columns(s, site.kv_groups, head_dim)
            for m in site.linears:
                ops.setdefault(f"{m}.weight", []).append(("col_mul", columns))
        return cls(path=ckpt.path, config=ckpt.config, weight_map=ckpt.weight_map, headers=ckpt.headers, ops=ops)

    def get(self, name: str) -> torch.Tensor:
        tensor = super().get(name)
        if name not in self.ops:
            return tensor
        t = tensor.float()
        for op, s in self.ops[name]:
            if op == "norm":
                t = t / s
            elif op == "offset_norm":
                t = (1.0 + t) / s - 1.0
            elif op == "row_div":
                t = t / (s if t.dim() == 1 else s[:, None])
            else:  # col_mul
                t = t * s
        return t.to(tensor.dtype)


@dataclass(frozen=True)
class SmoothingReport:
    alpha: float
    sites: int
    layers: int

    def describe(self) -> str:
        return f"SmoothQuant (alpha {self.alpha}): {self.sites} sites in {self.layers} layers"


def input_maxima(ckpt: Checkpoint, ids: torch.Tensor, batch_tokens: int = 2048) -> dict[str, torch.Tensor]:
    """Every Linear input's per-channel ``max |x|`` on calibration windows ``ids`` through the
    original model, one decoder layer in memory at a time."""
    from compress.decoder_stack import LazyDecoderStack
    from compress.layer_stream import LayerStream

    stream = LayerStream(LazyDecoderStack(ckpt), ids, batch_tokens=batch_tokens)
    maxima: dict[str, torch.Tensor] = {}
    for i in range(stream.stack.num_layers):
        maxima.update(stream.input_maxima(i))
    return maxima


def smoothed(ckpt: Checkpoint, maxima: dict[str, torch.Tensor],
             spec: SmoothingSpec) -> tuple[SmoothedCheckpoint, SmoothingReport]:
    """``ckpt`` read smoothed with factors from ``maxima`` (``input_maxima``) at ``spec.alpha``."""
    spec.check()
    sites = _sites_or_refuse(ckpt)
    factors = smoothing_factors(ckpt, sites, maxima, spec.alpha)
    layers = len({s.source.split(".layers.")[1].split(".")[0] for s in sites})
    return SmoothedCheckpoint.wrap(ckpt, factors), SmoothingReport(spec.alpha, len(sites), layers)


def smooth_checkpoint(ckpt: Checkpoint, ids: torch.Tensor, spec: SmoothingSpec,
                      batch_tokens: int = 2048) -> tuple[SmoothedCheckpoint, SmoothingReport]:
    """``smoothed`` on the maxima ``ids`` produce (checked before the calibration pass)."""
    spec.check()
    _sites_or_refuse(ckpt)
    return smoothed(ckpt, input_maxima(ckpt, ids, batch_tokens), spec)
