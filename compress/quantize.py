"""The streaming quantization driver: checkpoint dir -> compressed-tensors checkpoint dir.

Tensors are read one at a time from the source (``Checkpoint.get``) and written as they are
produced (``ShardWriter``), so peak memory is about one Linear plus one output shard. Targeted
Linears (attention and MLP projections, and an untied ``lm_head`` unless ignored) are quantized
by a ``WeightQuantizer``; every other tensor (embeddings, norms, biases) is copied unchanged, in
its source dtype, so the only difference from the source is the quantization itself. With
``dtype`` (e.g. bf16 for an fp32 source) every floating-point tensor is cast as it is read, so
the unquantized tensors and the weight scales are stored in that dtype, as if the source had
been saved in it; the quantization errors reported are against the source's own values.
Calibrated KV-cache scales (``k_scale`` / ``v_scale``) stay in the calibration's fp32.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Literal, Sequence

import torch
from tqdm import tqdm

from compress.algorithms import WeightQuantizer
from compress.algorithms.rtn import RTN
from compress.quantize_options import DEFAULT_IGNORE
from compress.summary import TensorStat, tensor_kind
from foundation.architecture import PROJECTIONS, model_type_of
from foundation.atomic import atomic_output_dir, check_output_dir
from foundation.checkpoint import Checkpoint, ShardWriter, write_config
from foundation.errors import KvslimError
from foundation.primitives import dequantize_linear
from foundation.schemes import W4A16, W8A16, QuantScheme
from foundation.tensor_shapes import (
    ModelShapes,
    check_checkpoint,
    kv_scale_rules,
    no_quantization,
)

# A pending shard is held in memory until it is written, so the shard size bounds the writer's
# share of peak memory: 7B INT4 GPTQ peaks at 1.92 GiB with 256 MiB shards
# (benchmarks/quant_streaming_memory.py, benchmarks/results/quant_streaming_memory.json).
DEFAULT_MAX_SHARD_BYTES = 256 * 2**20
_LAYER = re.compile(r"\.layers\.(\d+)\.")
LmHead = Literal["int8", "int4", "bf16"]
# The lm_head's own scheme (round-to-nearest): torch's weight-only CPU kernels take both.
LM_HEAD_SCHEMES: dict[str, QuantScheme] = {"int8": W8A16, "int4": W4A16.with_options(group_size=32, symmetric=True)}


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    scheme: QuantScheme
    algorithm: str
    ignore: tuple[str, ...]
    stats: tuple[TensorStat, ...]
    seconds: float


def quantization_config(scheme: QuantScheme, ignore: tuple[str, ...], kv_cache_scheme: dict | None = None,
                        lm_head: QuantScheme | None = None) -> dict:
    """``config.json["quantization_config"]`` exactly as compressed-tensors'
    ``ModelCompressor.update_config`` writes it after llm-compressor compressed a model;
    ``lm_head``: a second group naming ``lm_head`` (a name outranks the class ``Linear``)."""
    groups = {"group_0": scheme.to_config_group()}
    if lm_head is not None:
        groups["group_1"] = lm_head.to_config_group(targets=("lm_head",))
    formats = {g["format"] for g in groups.values()}
    return {
        "config_groups": groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": kv_cache_scheme,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": version("compressed-tensors"),
    }


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    """compressed-tensors' ``match_name``: an exact module name or a ``re:`` regex (re.match)."""
    return any(
        re.match(p.removeprefix("re:"), module) is not None if p.startswith("re:") else module == p
        for p in ignore
    )


def plan_linears(ckpt: Checkpoint, scheme: QuantScheme, ignore: tuple[str, ...]) -> list[str]:
    """Weight names of the Linears to quantize; raises before anything is written."""
    tied = bool(ckpt.config.get("tie_word_embeddings", False))
    linears = [
        n for n in ckpt.names()
        if n.endswith(".weight") and len(ckpt.shape(n)) == 2
        and (_module_of(n).rsplit(".", 1)[-1] in PROJECTIONS or _module_of(n) == "lm_head")
    ]
    if not any(_module_of(n).rsplit(".", 1)[-1] in PROJECTIONS for n in linears):
        raise KvslimError(f"{ckpt.path}: no attention/MLP projection weights (*_proj.weight) found")
    modules = [_module_of(n) for n in linears]
    for pattern in ignore:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern.removeprefix("re:"))
            except re.error as e:
                raise KvslimError(f"--ignore {pattern}: not a valid regular expression ({e})") from None
        if pattern != "lm_head" and not any(_ignored(m, (pattern,)) for m in modules):
            raise KvslimError(f"--ignore {pattern} matches no Linear module of the checkpoint")
    if tied and not _ignored("lm_head", ignore):
        raise KvslimError("lm_head is tied to the input embeddings and cannot be quantized; keep it in --ignore")
    chosen = [n for n in linears if not _ignored(_module_of(n), ignore)]
    for n in chosen:
        scheme.check_input_features(ckpt.shape(n)[1], _module_of(n))
    return chosen


def open_source(source: str | Path | Checkpoint) -> Checkpoint:
    """Open an unquantized source checkpoint whose tensors are all there, typed and shaped as its
    config implies (extra tensors are copied as they are); raises before any work is done. An
    already open ``Checkpoint`` (e.g. a ``SmoothedCheckpoint``) is checked and read as it is."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    model_type_of(ckpt.config)
    if ckpt.quantization_config is not None:
        method = ckpt.quantization_config.get("quant_method", "?")
        raise KvslimError(f"{ckpt.path} is already quantized ({method}); quantize an unquantized checkpoint")
    check_checkpoint(ckpt, ModelShapes.from_config(ckpt.config), no_quantization)  # extras are copied
    return ckpt


def _layer_of(name: str) -> int | None:
    m = _LAYER.search("." + name)
    return int(m.group(1)) if m else None


def _ordered(ckpt: Checkpoint, targets: set[str]) -> list[tuple[int | None, list[str]]]:
    """Group tensor names by decoder layer, in layer order; non-layer tensors last. Within a
    layer, the Linears to quantize come last, by increasing input features: GPTQ holds every
    Hessian of the layer until its Linear is done, so the widest (down_proj's, 484 MB at 7B) is
    inverted after the others are freed."""
    groups: dict[int | None, list[str]] = {}
    for n in ckpt.names():
        groups.setdefault(_layer_of(n), []).append(n)
    for group in groups.values():
        group.sort(key=lambda n: (n in targets, ckpt.shape(n)[-1] if n in targets else 0, n))
    layers = sorted(k for k in groups if k is not None)
    return [(k, groups[k]) for k in layers] + ([(None, groups[None])] if None in groups else [])


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def quantize_checkpoint(
    source: str | Path | Checkpoint,
    out: str | Path,
    scheme: QuantScheme,
    ignore: tuple[str, ...] = DEFAULT_IGNORE,
    quantizer: WeightQuantizer | None = None,
    force: bool = False,
    progress: bool = True,
    kv_cache_scheme: dict | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    finish: Callable[[Path], None] | None = None,
    linears: Sequence[str] | None = None,
    lm_head: LmHead | None = None,
) -> QuantizeResult:
    """Quantize ``source`` (an HF checkpoint directory) into ``out`` (written atomically);
    ``dtype`` casts every floating-point tensor first (default: keep the source's). ``finish``
    runs on the complete output directory before it is published (e.g. scale tuning).

    ``linears``: what ``plan_linears`` already chose for ``source`` (then the ``Checkpoint`` that
    ``open_source`` returned, or a reading of it such as a ``SmoothedCheckpoint``) with this
    ``scheme`` and ``ignore``, ``out`` having passed ``check_output_dir``: none of that runs again.
    Without it the output is checked, the source opened and the Linears planned here.

    ``lm_head`` ("int8" | "int4" | "bf16"): the output projection written apart from ``scheme``,
    round-to-nearest (``LM_HEAD_SCHEMES``) or as a bf16 copy; a tied one is untied (the copy of
    the embedding becomes ``lm_head.weight``, ``tie_word_embeddings`` false)."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise KvslimError(f"output dtype {dtype}: expected bfloat16, float16 or float32")
    quantizer = quantizer or RTN()
    start = time.perf_counter()
    out = Path(out)
    ignore = tuple(dict.fromkeys(ignore))
    if linears is None:
        check_output_dir(out.expanduser().resolve(), force)
        ckpt = open_source(source)
        linears = plan_linears(ckpt, scheme, ignore)
    elif isinstance(source, Checkpoint):
        ckpt = source
    else:
        raise TypeError("planned linears come with the opened Checkpoint they were planned on")
    targets = set(linears)
    if lm_head is not None and "lm_head.weight" in targets:
        raise KvslimError("lm_head is both a quantization target and given its own --lm-head scheme; keep it in --ignore")
    stats: list[TensorStat] = []
    with atomic_output_dir(out, force=force, checked=True) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes=max_shard_bytes)
        groups = _ordered(ckpt, targets)
        bar = tqdm(groups, desc=f"quantize {scheme.name}", unit="layer", disable=not progress)
        for layer, names in bar:
            bar.set_postfix_str("other" if layer is None else f"layer {layer}")
            for name in names:
                if lm_head is not None and name == "lm_head.weight":
                    continue  # written by _write_lm_head
                original = ckpt.get(name)
                tensor = original.to(dtype) if dtype is not None and original.is_floating_point() else original
                if name in targets:
                    stats.append(_quantize_one(name, original, tensor, scheme, quantizer, writer))
                else:
                    writer.add(name, tensor)
                    stats.append(_stat(name, original, _nbytes(tensor), False, None))
        if lm_head is not None:
            stats.append(_write_lm_head(ckpt, lm_head, dtype, writer))
        extras = quantizer.finish()
        _check_kv_scales(ckpt, kv_cache_scheme, extras)
        for name, tensor in extras.items():
            writer.add(name, tensor)
        writer.close()
        config = dict(ckpt.config)
        if dtype is not None:
            for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
                config[key] = str(dtype).removeprefix("torch.")
        head_scheme = LM_HEAD_SCHEMES.get(lm_head)
        if lm_head is not None:
            config["tie_word_embeddings"] = False
            if head_scheme is not None:
                ignore = tuple(p for p in ignore if p != "lm_head")
        config["quantization_config"] = quantization_config(scheme, ignore, kv_cache_scheme, head_scheme)
        write_config(tmp, config)
        ckpt.copy_side_files(tmp)
        if finish is not None:
            finish(tmp)
    return QuantizeResult(out.expanduser().resolve(), scheme, quantizer.name, ignore, tuple(stats),
                          time.perf_counter() - start)


def _write_lm_head(ckpt: Checkpoint, lm_head: LmHead, dtype: torch.dtype | None, writer: ShardWriter) -> TensorStat:
    """The output projection (the embedding's copy when tied), quantized RTN or cast to bf16."""
    source = "lm_head.weight" if ckpt.has("lm_head.weight") else "model.embed_tokens.weight"
    original = ckpt.get(source)
    weight = original.to(dtype) if dtype is not None else original
    scheme = LM_HEAD_SCHEMES.get(lm_head)
    if scheme is None:
        stored = weight.to(torch.bfloat16)
        writer.add("lm_head.weight", stored)
        return _stat("lm_head.weight", original, _nbytes(stored), False, None)
    return _quantize_one("lm_head.weight", original, weight, scheme, RTN(), writer)


def _check_kv_scales(ckpt: Checkpoint, kv_cache_scheme: dict | None, extras: dict[str, torch.Tensor]) -> None:
    """Refuse an output that would declare ``kv_cache_scheme`` without the scales it promises."""
    rules = kv_scale_rules(ModelShapes.from_config(ckpt.config), kv_cache_scheme)
    missing = [n for n in rules if n not in extras]
    if missing:
        raise KvslimError(
            f"kv_cache_scheme is declared but {len(missing)} of {len(rules)} KV-cache scales were not "
            f"calibrated (first: {missing[0]}); nothing was written"
        )


def _quantize_one(
    name: str, original: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, quantizer: WeightQuantizer,
    writer: ShardWriter,
) -> TensorStat:
    """Quantize ``weight`` (``original`` cast to the output dtype) and write its tensors."""
    module = _module_of(name)
    tensors = quantizer.quantize(module, weight, scheme)
    after = 0
    for key, t in tensors.items():
        writer.add(f"{module}.{key}", t)
        after += _nbytes(t)
    return _stat(name, original, after, True, dequantize_linear(tensors, scheme))


def _stat(name: str, original: torch.Tensor, bytes_after: int, quantized: bool,
          stored: torch.Tensor | None) -> TensorStat:
    """Bytes, and for a quantized tensor the error of ``stored`` (what a loader reconstructs)
    against the source's ``original``; None (unquantized tensors, stored as is or cast): no error
    statistics, which the reports show only for quantized tensors."""
    mean_err = max_err = rel = 0.0
    if stored is not None:
        mean_err, max_err, rel = _error_stats(stored, original)
    return TensorStat(name, tensor_kind(name), str(original.dtype).removeprefix("torch."), original.numel(),
                      _nbytes(original), bytes_after, quantized, mean_err, max_err, rel)


_STAT_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries of 16 MB, not several copies of a whole 7B weight


def _error_stats(stored: torch.Tensor, original: torch.Tensor) -> tuple[float, float, float]:
    """Mean and max ``|stored - original|`` and the relative Frobenius error, row chunk by chunk."""
    rows = max(1, _STAT_CHUNK_ELEMENTS // original.shape[-1])
    abs_sum = sq_err = sq_ref = 0.0
    max_err = 0.0
    for s, o in zip(stored.split(rows), original.split(rows)):
        diff = s.float() - o.float()
        abs_sum += float(diff.abs().sum(dtype=torch.float64))
        max_err = max(max_err, float(diff.abs().max()))
        sq_err += float(diff.square().sum(dtype=torch.float64))
        sq_ref += float(o.float().square().sum(dtype=torch.float64))
    rel = sq_err**0.5 / max(sq_ref**0.5, 1e-30)
    return abs_sum / original.numel(), max_err, rel
