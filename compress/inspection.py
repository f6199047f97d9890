"""Describe a checkpoint without loading it: layout, scheme, bytes, KV per token, kernel fit."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import prod
from pathlib import Path

from compress.transformers_compat import loading_note
from compress.vllm_compat import KernelVerdict, kernel_verdicts
from foundation.architecture import model_type_of
from foundation.attention_layout import AttentionLayout
from foundation.bnb_scheme import BnbScheme, bnb_tensor_rules
from foundation.checkpoint import Checkpoint
from foundation.kv_dtype_mix import KvDtypeMix
from foundation.kv_plan_file import PLAN_KV_DTYPES, read_plan
from foundation.quant_spec import QuantSpec
from foundation.schemes import QuantScheme
from foundation.tensor_shapes import (
    ModelShapes,
    check_checkpoint,
    check_tensors,
    expected_tensors,
    no_quantization,
    not_understood,
)

# safetensors dtype name -> bytes per element
DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# Quantization side tensors: not parameters of the model.
_AUX = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight_global_scale",
        "input_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class QuantizedLinear:
    name: str  # module name
    in_features: int
    out_features: int
    verdicts: tuple[KernelVerdict, ...]


@dataclass(frozen=True)
class Inspection:
    path: Path
    architecture: str
    model_type: str
    layout: AttentionLayout
    tied_embeddings: bool
    scheme: QuantScheme | None
    quant_format: str | None
    ignore: tuple[str, ...]
    bytes_by_dtype: dict[str, int]
    num_params: int
    linears: tuple[QuantizedLinear, ...]
    max_context: int
    unread: tuple[str, ...] = ()  # tensors the kvslim runtime does not read (e.g. a foreign input_scale)
    kv_plan: dict | None = None  # plan.json (compress convert --kv-budget)
    bnb: BnbScheme | None = None  # a bitsandbytes checkpoint (compress quantize --nf4 / --int8-bnb)
    other_groups: tuple[str, ...] = ()  # quantization groups beside the main one (e.g. "lm_head: W8A16 ...")

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def kv_bytes_per_token(self, context: int, dtype_bytes: float, scale_bytes: float = 0.0) -> float:
        return self.layout.kv_bytes_per_token(context, dtype_bytes, scale_bytes)


def inspect_checkpoint(path: str | Path) -> Inspection:
    """Read config and safetensors headers (plus the tiny ``weight_shape`` tensors).

    Raises ``CheckpointError`` for a tensor missing, misshapen or of the wrong dtype for what the
    config declares: inspect is how users check a checkpoint. Tensors the kvslim runtime would not
    read are listed (``unread``), not refused: other loaders (vLLM) may use them."""
    ckpt = Checkpoint.open(path)
    config = ckpt.config
    model_type = model_type_of(config)
    layout = AttentionLayout.from_config(config)
    bnb = BnbScheme.of_model_config(config)
    if bnb is not None:
        return _inspect_bnb(ckpt, model_type, layout, bnb)
    quant = QuantSpec.of_model_config(config)
    group = quant.main_group if quant else None
    scheme = group.scheme if group else None
    others = tuple(f"{', '.join(g.targets)}: {g.scheme.describe()}" for g in quant.groups if g is not group) if quant else ()
    fmt = (group.format or quant.format) if quant else None
    ignore = quant.ignore if quant else ()
    unread = check_checkpoint(ckpt, ModelShapes.from_config(config, layout),
                              quant.scheme_for if quant else no_quantization)
    by_dtype: Counter[str] = Counter()
    params = 0
    linears: list[QuantizedLinear] = []
    for name, (dtype, shape) in ckpt.headers.items():
        by_dtype[dtype] += prod(shape) * DTYPE_BYTES.get(dtype, 0)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _AUX:
            continue
        module = name.rsplit(".", 1)[0]
        if leaf == "weight_packed":
            out_f, in_f = (int(v) for v in ckpt.get(f"{module}.weight_shape").tolist())
        else:
            out_f, in_f = (shape[0], shape[1]) if len(shape) == 2 else (0, 0)
        params += out_f * in_f if leaf == "weight_packed" else prod(shape)
        linear_scheme = quant.scheme_for(module) if quant else None
        if linear_scheme is not None and ckpt.has(f"{module}.weight_scale") and leaf in ("weight", "weight_packed"):
            linears.append(QuantizedLinear(module, in_f, out_f, kernel_verdicts(linear_scheme, in_f, out_f)))
    arch = ",".join(config.get("architectures") or [model_type])
    max_ctx = int(config.get("max_position_embeddings") or 4096)
    return Inspection(
        Path(path), arch, model_type, layout, bool(config.get("tie_word_embeddings", False)), scheme, fmt,
        ignore, dict(by_dtype), params, tuple(sorted(linears, key=lambda l: _sort_key(l.name))), max_ctx,
        tuple(unread), read_plan(ckpt.path), other_groups=others,
    )


def _inspect_bnb(ckpt: Checkpoint, model_type: str, layout: AttentionLayout, bnb: BnbScheme) -> Inspection:
    config = ckpt.config
    shapes = ModelShapes.from_config(config, layout)
    rules = bnb_tensor_rules(shapes, bnb)
    check_tensors(ckpt, rules)
    by_dtype: Counter[str] = Counter()
    for dtype, shape in ckpt.headers.values():
        by_dtype[dtype] += prod(shape) * DTYPE_BYTES.get(dtype, 0)
    params = sum(prod(r.shape) for r in expected_tensors(shapes, no_quantization).values())
    arch = ",".join(config.get("architectures") or [model_type])
    return Inspection(ckpt.path, arch, model_type, layout, bool(config.get("tie_word_embeddings", False)), None,
                      "bitsandbytes", (), dict(by_dtype), params, (), int(config.get("max_position_embeddings") or 4096),
                      tuple(not_understood(ckpt, rules, shapes)), None, bnb)


def _sort_key(name: str) -> tuple:
    parts = name.split(".")
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_inspection(ins: Inspection, per_layer: bool = False) -> str:
    """The human-readable report ``compress inspect`` prints."""
    lay = ins.layout
    lines = [f"checkpoint: {ins.path}", f"architecture: {ins.architecture} (model_type {ins.model_type})"]
    lines.append(
        f"attention: {lay.num_layers} layers, {lay.num_heads} heads x {lay.head_dim}, "
        f"{lay.num_kv_heads} KV heads (GQA {lay.num_heads // max(lay.num_kv_heads, 1)}:1)"
    )
    sliding = lay.sliding_layers()
    if sliding:
        windows = sorted({lay.layers[i].window for i in sliding})
        sinks = sorted({lay.layers[i].sinks for i in sliding})
        sink_text = f" + {', '.join(map(str, sinks))} attention sinks" if sinks != [0] else ""
        lines.append(f"  sliding window {', '.join(map(str, windows))}{sink_text} on {len(sliding)} layers "
                     f"{sliding}; full attention on {lay.num_layers - len(sliding)}")
    else:
        lines.append("  full attention on every layer")
    streaming = [l.streaming for l in lay.layers if l.streaming is not None]
    if streaming and streaming[0].window >= ins.max_context and not streaming[0].sinks:  # KV bits per head
        lines.append(f"  {lay.num_streaming_kv_heads} of {lay.num_layers * lay.num_kv_heads} KV heads ({len(streaming)} "
                     "layers) in a cache group of their own, still attending to everything (window: every position)")
    elif streaming:
        lines.append(f"  streaming heads: {lay.num_streaming_kv_heads} of {lay.num_layers * lay.num_kv_heads} KV heads "
                     f"({len(streaming)} layers) attend to {streaming[0].sinks} sinks + the last {streaming[0].window} "
                     "tokens; the rest to everything")
    owners = lay.cache_owners()
    if len(owners) < lay.num_layers:
        shared = {i: l.kv_source for i, l in enumerate(lay.layers) if l.kv_source != i}
        lines.append(f"  KV sharing: {len(owners)} layers own a cache; readers -> owner {shared}")
    else:
        lines.append("  KV sharing: none (every layer owns its cache)")
    if ins.bnb is not None:
        lines.append(f"quantization: {ins.bnb.describe()}; loads in transformers (bitsandbytes installed) and vLLM "
                     "(--quantization bitsandbytes); the kvslim runtime serves compressed-tensors checkpoints")
    elif ins.scheme is None:
        lines.append("quantization: none (dense weights)")
    else:
        lines.append(f"quantization: {ins.scheme.describe()}; format {ins.quant_format}; ignore {list(ins.ignore)}")
        lines.extend(f"  {g}" for g in ins.other_groups)
    dtypes = ", ".join(f"{d} {_mib(b)}" for d, b in sorted(ins.bytes_by_dtype.items(), key=lambda kv: -kv[1]))
    lines.append(f"weights: {_mib(ins.total_bytes)} ({dtypes}); {ins.num_params:,} parameters "
                 f"({ins.num_params * 2 / 2**20:,.2f} MiB in bf16){'; tied embeddings' if ins.tied_embeddings else ''}")
    contexts = sorted({c for c in (2048, ins.max_context) if c > 0})
    for ctx in contexts:
        bf16 = ins.kv_bytes_per_token(ctx, 2)
        fp8 = ins.kv_bytes_per_token(ctx, 1)
        fp8s = ins.kv_bytes_per_token(ctx, 1, 4)
        lines.append(f"KV cache per token at context {ctx}: bf16 {bf16 / 1024:,.2f} KiB, fp8 {fp8 / 1024:,.2f} KiB "
                     f"(+ fp32 per-token-head scales: {fp8s / 1024:,.2f} KiB)")
    groups = lay.cache_groups()
    plan = ins.kv_plan
    mix = KvDtypeMix.parse(plan["kv_cache_dtype"], PLAN_KV_DTYPES) if plan is not None else None
    if len(groups) > 1:
        ctx = contexts[0]
        lines.append(f"KV cache groups (bf16, per token at context {ctx}):")
        for (kind, window, sinks, kvh), entries in groups.items():
            span = "full" if window is None else f"window {window}" + (f" + {sinks} sinks" if sinks else "")
            served = f"; the plan serves it in {mix.of(kind)}" if mix is not None and len(mix.dtypes) > 1 else ""
            lines.append(f"  {span}, {kvh} KV head{'s' if kvh > 1 else ''} x {len(entries)} entries: "
                         f"{lay.kv_bytes_per_token(ctx, 2, entries=entries):,.0f} B/token{served}")
    if plan is not None:
        dev = ""
        if plan.get("dev_ppl") and plan.get("original_dev_ppl"):
            dev = (f"; dev ppl {plan['dev_ppl']:.3f} vs {plan['original_dev_ppl']:.3f} "
                   f"({100 * (plan['dev_ppl'] / plan['original_dev_ppl'] - 1):+.2f}%, served)")
        lines.append(f"KV plan ({plan.get('choice', plan['kv_cache_dtype'])}): KV {plan.get('kv_bytes_per_token', 0):,.0f} "
                     f"B/token @{plan.get('ctx')} = {plan.get('times_smaller', 0):.2f}x smaller than the bf16 original"
                     f"{dev}; served with {plan['kv_cache_dtype']} KV by default")
    if ins.linears:
        lines.append(f"vLLM kernels ({len(ins.linears)} quantized Linears):")
        if per_layer:
            for l in ins.linears:
                lines.append(f"  {l.name} [{l.in_features}->{l.out_features}]: "
                             + "; ".join(v.describe() for v in l.verdicts))
        else:
            groups: dict[tuple, list[str]] = {}
            for l in ins.linears:
                key = (l.name.rsplit(".", 1)[-1], l.in_features, l.out_features, l.verdicts)
                groups.setdefault(key, []).append(l.name)
            for (short, i, o, verdicts), names in groups.items():
                lines.append(f"  {short} [{i}->{o}] x{len(names)}: " + "; ".join(v.describe() for v in verdicts))
        for kernel in sorted({v.kernel for l in ins.linears for v in l.verdicts}):
            ok = sum(1 for l in ins.linears for v in l.verdicts if v.kernel == kernel and v.ok)
            lines.append(f"  {kernel} accepts {ok}/{len(ins.linears)} layers")
    note = loading_note(ins.scheme)
    if note:
        lines.append(note.replace("note: ", "warning: ", 1))
    if ins.unread:
        more = f" and {len(ins.unread) - 3} more" if len(ins.unread) > 3 else ""
        lines.append(f"not read by the kvslim runtime (it refuses to load them; other loaders may use them): "
                     f"{', '.join(ins.unread[:3])}{more}")
    return "\n".join(lines)
