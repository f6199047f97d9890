"""`compress export --gguf`: a Llama-architecture checkpoint as one llama.cpp GGUF file.

Quantized Linears keep their codes (``compress.gguf_blocks``: no re-quantization where a GGML
block holds them exactly); a scheme no block holds is refused unless ``requantize`` lets gguf's
own quantizer (llama.cpp's round-to-nearest) redo it from our dequantized weights. Unquantized
Linears stay in their float dtype under ``auto`` and are quantized by gguf under a named type.
Embeddings and an untied lm_head keep their float dtype (or gguf's Q8_0 on request, as llama.cpp's
own Q4 files store them); norms are F32, as llama.cpp wants.

The file streams: tensor infos are planned first, then each tensor is encoded and written in
turn (one tensor in memory), into a temp file renamed into place at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
import torch

from compress.gguf_blocks import BLOCK, encode_blocks, exact_type_for, exact_type_reason
from compress.gguf_vocab import add_vocab
from foundation.architecture import model_type_of
from foundation.atomic import atomic_output_file
from foundation.attention_layout import AttentionLayout
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.kv_plan_file import read_plan
from foundation.primitives import LINEAR_TENSORS, decode_linear, dequantize_linear
from foundation.quant_spec import QuantSpec, kv_cache_scheme_of
from foundation.schemes import QuantScheme
from foundation.tensor_shapes import ModelShapes, check_checkpoint, layer_linears, no_quantization

GgufChoice = Literal["auto", "q8_0", "q4_1", "q4_0"]
Q = gguf.GGMLQuantizationType
_QUANT_TYPES = {"q8_0": Q.Q8_0, "q4_1": Q.Q4_1, "q4_0": Q.Q4_0}
_FLOAT_TYPES = {torch.float32: Q.F32, torch.bfloat16: Q.BF16, torch.float16: Q.F16}
_TORCH_OF = {Q.F32: torch.float32, Q.BF16: torch.bfloat16, Q.F16: torch.float16}
_FILE_TYPE = {Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
              Q.F16: gguf.LlamaFileType.MOSTLY_F16, Q.F32: gguf.LlamaFileType.ALL_F32}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

Source = Literal["exact", "float", "gguf-quantized", "requantized"]
Embeddings = Literal["float", "q8_0"]


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: where it comes from and how it is stored."""

    name: str  # the checkpoint tensor it reads ("float", "gguf-quantized") or the Linear module (codes)
    gguf_name: str
    shape: tuple[int, ...]  # [out, in] or [n]
    ggml_type: gguf.GGMLQuantizationType
    source: Source
    scheme: QuantScheme | None = None
    heads: int | None = None  # q/k projections: llama.cpp's row order for this many heads

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.ggml_type]
        rows = self.shape[0] if len(self.shape) == 2 else 1
        return rows * (self.shape[-1] // block) * size


@dataclass(frozen=True)
class GgufExport:
    """What ``export_gguf`` wrote."""

    path: Path
    file_bytes: int
    tensors: tuple[TensorPlan, ...]
    tokenizer_pre: str
    max_scale_rel_change: float
    max_offset_rel_change: float
    notes: tuple[str, ...] = field(default=())

    def count(self, source: Source) -> int:
        return sum(t.source == source for t in self.tensors)


def llama_row_order(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (HF's rotate-half layout) in llama.cpp's interleaved rope order."""
    out = rows.shape[0]
    return rows.reshape(heads, 2, out // heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def check_exportable(config: dict) -> AttentionLayout:
    """The checkpoint's attention layout if llama.cpp's ``llama`` architecture expresses it."""
    model_type = model_type_of(config)
    if model_type != "llama":
        arch = ",".join(config.get("architectures") or [model_type])
        raise KvslimError(f"GGUF export writes Llama-architecture checkpoints; this one is {arch}")
    layout = AttentionLayout.from_config(config)
    rewrites = []
    if layout.sliding_layers():
        rewrites.append("sliding-window layers")
    if any(l.kv_source != i for i, l in enumerate(layout.layers)):
        rewrites.append("cross-layer KV sharing")
    if layout.streaming_layers():
        rewrites.append("streaming heads")
    if rewrites:
        raise KvslimError(f"llama.cpp cannot express this checkpoint's {' and '.join(rewrites)}; "
                          "export the checkpoint before `compress convert`")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise KvslimError("GGUF export does not write Llama checkpoints with attention or MLP biases")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise KvslimError(f"GGUF export writes default rope only; this checkpoint has rope type {rope_type!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise KvslimError(f"llama.cpp's llama runs SiLU MLPs; this checkpoint has {config['hidden_act']!r}")
    return layout


def _float_type(ckpt: Checkpoint, name: str) -> gguf.GGMLQuantizationType:
    dtype = ckpt.headers[name][0]
    if dtype not in _SAFETENSORS_DTYPES:
        raise KvslimError(f"{name}: dtype {dtype} has no GGML float type")
    return _FLOAT_TYPES[_SAFETENSORS_DTYPES[dtype]]


def _linear_plan(ckpt: Checkpoint, module: str, shape: tuple[int, int], gguf_name: str, scheme: QuantScheme | None,
                 choice: GgufChoice, requantize: bool, heads: int | None) -> TensorPlan:
    if shape[1] % BLOCK and (scheme is not None or choice != "auto"):
        raise KvslimError(f"{module}: {shape[1]} input columns are not a multiple of GGML's {BLOCK}-column blocks")
    if scheme is None:
        if choice == "auto":
            return TensorPlan(f"{module}.weight", gguf_name, shape, _float_type(ckpt, f"{module}.weight"), "float",
                              heads=heads)
        return TensorPlan(f"{module}.weight", gguf_name, shape, _QUANT_TYPES[choice], "gguf-quantized", heads=heads)
    target = (exact_type_for(scheme) or "q8_0") if choice == "auto" else choice
    reason = exact_type_reason(scheme, target)
    if reason is None and ckpt.has(f"{module}.weight_g_idx"):
        reason = "act-order groups (weight_g_idx) are not contiguous column blocks"
    if reason is None:
        return TensorPlan(module, gguf_name, shape, _QUANT_TYPES[target], "exact", scheme, heads)
    if not requantize:
        raise KvslimError(f"{module}: {target} cannot hold {scheme.name} exactly ({reason}); "
                          "pass --requantize to let gguf re-quantize it (round-to-nearest)")
    return TensorPlan(module, gguf_name, shape, _QUANT_TYPES[target], "requantized", scheme, heads)


def plan_tensors(ckpt: Checkpoint, choice: GgufChoice, requantize: bool, embeddings: Embeddings = "float"
                 ) -> list[TensorPlan]:
    """Every tensor of the GGUF file, in file order, with its GGML type and source."""
    config = ckpt.config
    layout = check_exportable(config)
    shapes = ModelShapes.from_config(config, layout)
    quant = QuantSpec.of_model_config(config)
    check_checkpoint(ckpt, shapes, quant.scheme_for if quant else no_quantization)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layout.num_layers)

    def gguf_name(name: str) -> str:
        return name_map.get_name(name, try_suffixes=(".weight",))

    def float_plan(name: str, shape: tuple[int, ...]) -> TensorPlan:
        ggml_type = Q.F32 if len(shape) == 1 else _float_type(ckpt, name)
        return TensorPlan(name, gguf_name(name), shape, ggml_type, "float")

    def embedding_plan(name: str, shape: tuple[int, int]) -> TensorPlan:
        if embeddings == "float":
            return float_plan(name, shape)
        if shape[1] % BLOCK:
            raise KvslimError(f"{name}: {shape[1]} columns are not a multiple of GGML's {BLOCK}-column blocks")
        return TensorPlan(name, gguf_name(name), shape, Q.Q8_0, "gguf-quantized")

    embed = (shapes.vocab_size, shapes.hidden_size)
    plans = [embedding_plan("model.embed_tokens.weight", embed)]
    heads = {"q_proj": layout.num_heads, "k_proj": layout.num_kv_heads}
    for i in range(layout.num_layers):
        p = f"model.layers.{i}."
        plans.append(float_plan(f"{p}input_layernorm.weight", (shapes.hidden_size,)))
        for proj, linear in layer_linears(shapes, i).items():
            scheme = quant.scheme_for(linear.module) if quant else None
            plans.append(_linear_plan(ckpt, linear.module, (linear.out_features, linear.in_features),
                                      gguf_name(f"{linear.module}.weight"), scheme, choice, requantize,
                                      heads.get(proj)))
        plans.append(float_plan(f"{p}post_attention_layernorm.weight", (shapes.hidden_size,)))
    plans.append(float_plan("model.norm.weight", (shapes.hidden_size,)))
    if not shapes.tie_word_embeddings:
        head = quant.scheme_for("lm_head") if quant else None
        if head is not None:  # its own codes, in the type that holds them exactly (`--lm-head`)
            plans.append(_linear_plan(ckpt, "lm_head", embed, gguf_name("lm_head.weight"), head, "auto", requantize,
                                      None))
        else:
            plans.append(embedding_plan("lm_head.weight", embed))
    return plans


@dataclass
class _Changes:
    scale: float = 0.0
    offset: float = 0.0


def _encode(ckpt: Checkpoint, plan: TensorPlan, changes: _Changes) -> np.ndarray:
    """The plan's tensor as GGML bytes (uint8)."""
    if plan.source in ("exact", "requantized"):
        tensors = {k: ckpt.get(f"{plan.name}.{k}") for k in LINEAR_TENSORS if ckpt.has(f"{plan.name}.{k}")}
    if plan.source == "exact":
        q, scale, zp, _ = decode_linear(tensors, plan.scheme)
        if plan.heads:
            q, scale = llama_row_order(q, plan.heads), llama_row_order(scale, plan.heads)
            zp = llama_row_order(zp, plan.heads) if zp is not None else None
        enc = encode_blocks(q, scale, zp, plan.scheme, plan.ggml_type.name.lower())
        changes.scale = max(changes.scale, enc.max_scale_rel_change)
        changes.offset = max(changes.offset, enc.max_offset_rel_change)
        return enc.data
    if plan.source == "requantized":
        weight = dequantize_linear(tensors, plan.scheme)
    else:
        weight = ckpt.get(plan.name)
    if plan.heads:
        weight = llama_row_order(weight, plan.heads)
    if plan.ggml_type in _TORCH_OF:
        return weight.to(_TORCH_OF[plan.ggml_type]).contiguous().view(torch.uint8).numpy()
    return gguf.quants.quantize(weight.float().numpy(), plan.ggml_type)


def _add_metadata(writer: gguf.GGUFWriter, config: dict, plans: list[TensorPlan], name: str) -> None:
    layout = AttentionLayout.from_config(config)
    rope = config.get("rope_parameters") or {}
    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(layout.num_layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(layout.num_heads)
    writer.add_head_count_kv(layout.num_kv_heads)
    writer.add_key_length(layout.head_dim)
    writer.add_value_length(layout.head_dim)
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    linear_types = [p.ggml_type for p in plans if len(p.shape) == 2 and p.gguf_name.startswith("blk.")]
    writer.add_file_type(_FILE_TYPE[max(set(linear_types), key=linear_types.count)])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(checkpoint: str | Path, out: str | Path, choice: GgufChoice = "auto", requantize: bool = False,
                tokenizer_pre: str | None = None, force: bool = False, embeddings: Embeddings = "float") -> GgufExport:
    """Write ``checkpoint`` as the llama.cpp GGUF file ``out`` (see the module docstring);
    ``embeddings="q8_0"``: the embedding (and an untied lm_head) quantized by gguf to Q8_0."""
    ckpt = Checkpoint.open(checkpoint)
    plans = plan_tensors(ckpt, choice, requantize, embeddings)
    notes = []
    if kv_cache_scheme_of(ckpt.config):
        notes.append("the checkpoint's KV-cache scales are not carried: llama.cpp picks its KV cache type at run "
                     "time (--cache-type-k / --cache-type-v)")
    if read_plan(ckpt.path) is not None:
        notes.append("plan.json (a KV plan) is not carried: llama.cpp has no per-layer KV layout")
    changes = _Changes()
    with atomic_output_file(out, force) as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        _add_metadata(writer, ckpt.config, plans, str(ckpt.config.get("_model_name_or_path") or ckpt.path.name))
        pre = add_vocab(writer, ckpt.path, int(ckpt.config["vocab_size"]), tokenizer_pre)
        for plan in plans:
            byte_shape = (*plan.shape[:-1], plan.nbytes // max(1, int(np.prod(plan.shape[:-1]))))
            writer.add_tensor_info(plan.gguf_name, byte_shape, np.dtype(np.uint8), plan.nbytes, raw_dtype=plan.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for plan in plans:
            writer.write_tensor_data(_encode(ckpt, plan, changes))
        writer.close()
        size = tmp.stat().st_size
    return GgufExport(Path(out), size, tuple(plans), pre, changes.scale, changes.offset, tuple(notes))
