"""`compress convert`: rewrite a checkpoint's attention (GQA/MQA, KV sharing, hybrid sliding, sinks,
streaming heads).

The rewrites combine in one pass, in this order: merge KV heads, share KV across layers (within
runs of layers of the same kind), then mark layers local/global, with attention sinks on the
local ones. Streaming heads (sinks + window per KV head, ``attention_variants.streaming_heads``)
stand alone: they are chosen by scoring the checkpoint's own heads. The output is a plain HF
checkpoint whose config states the new layout; where transformers cannot express it (KV sharing,
sinks or streaming heads anywhere; per-layer windows on Llama/Mistral) it also carries our
modeling file (``auto_map``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from attention_variants import gqa, kv_sharing, sliding
from attention_variants.attention_inputs import AttentionInputs, capture_attention_inputs
from attention_variants.modeling_files import CAUSAL_LM_CLASSES, KV_SHARING_TYPES, auto_map_for, write_modeling_file
from attention_variants.streaming_heads import (
    STREAMING_SELECTS,
    StreamingSelect,
    auto_fraction,
    head_scores,
    streaming_kv_heads,
)
from foundation.architecture import model_type_of
from foundation.atomic import atomic_output_dir, check_output_dir
from foundation.attention_layout import KV_SOURCE_KEY, SINKS_KEY, STREAMING_KEY, AttentionLayout
from foundation.calibration import CalibrationSpec, calibration_ids
from foundation.checkpoint import Checkpoint, ShardWriter, write_config
from foundation.errors import KvslimError, UnsupportedArchitecture
from foundation.texts import DEFAULT_CALIB

NATIVE_HYBRID = ("qwen2", "qwen3", "gemma3_text")  # transformers honours layer_types for these
STREAMING_TYPES = (*KV_SHARING_TYPES, "gemma3_text")  # whose classes in our modeling file mask per head
# Calibration windows: the rewrites fit on every layer's attention inputs, held in memory at once.
DEFAULT_CALIB_SEQS = 2
DEFAULT_CALIB_SEQ_LEN = 1024
DEFAULT_SINKS = 4  # StreamingLLM: 4 initial tokens restore a window-only model's perplexity


@dataclass(frozen=True)
class ConvertSpec:
    """What to rewrite. ``None`` leaves that aspect of the layout as it is."""

    kv_heads: int | None = None
    kv_share: int | None = None
    kv_share_select: kv_sharing.SupplierSelect = "first"
    sliding_window: int | None = None
    global_every: int | None = None
    global_layers: tuple[int, ...] | None = None
    global_select: sliding.GlobalSelect = "fixed"
    sinks: int = 0  # attention sinks on the sliding layers (the new ones, or the model's own)
    # streaming heads over ``sliding_window`` + ``sinks``: a fraction of all KV heads (or "auto"),
    # ranked by ``streaming_select``; or the heads per layer, given (``streaming_set``)
    streaming_heads: float | Literal["auto"] | None = None
    streaming_select: StreamingSelect = "mass"
    streaming_set: tuple[tuple[int, ...], ...] | None = None
    merge: gqa.MergeMethod = "calib"  # GQA merge, and whether KV-sharing readers get fitted maps
    calib: str | None = None  # named text range or file (default wikipedia:calib)
    calib_seqs: int = DEFAULT_CALIB_SEQS
    calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN

    def describe(self) -> str:
        parts = []
        if self.kv_heads is not None:
            parts.append("MQA" if self.kv_heads == 1 else f"GQA {self.kv_heads} KV heads")
            parts[-1] += f" ({self.merge} merge)"
        if self.kv_share is not None:
            parts.append(f"KV shared in groups of {self.kv_share} ({self.kv_share_select} supplier, "
                         f"{'fitted' if self.merge == 'calib' else 'plain'} readers)")
        if self.streams:
            which = (f"{self.streaming_heads:g} of the KV heads" if isinstance(self.streaming_heads, float)
                     else "auto share of the KV heads" if self.streaming_heads == "auto" else "given KV heads")
            how = f", ranked by {self.streaming_select}" if self.streaming_set is None else ""
            parts.append(f"streaming heads: {which} over window {self.sliding_window}{how}")
        elif self.sliding_window is not None:
            which = f"layers {list(self.global_layers)}" if self.global_layers is not None else f"1 in {self.global_every}"
            parts.append(f"sliding window {self.sliding_window}, global {which} ({self.global_select})")
        if self.sinks:
            parts.append(f"{self.sinks} attention sinks")
        return " + ".join(parts)

    @property
    def streams(self) -> bool:
        """Whether streaming heads are asked for."""
        return self.streaming_heads is not None or self.streaming_set is not None

    @property
    def needs_attention_inputs(self) -> bool:
        fitted = (self.kv_heads is not None and self.merge != "mean") or (self.kv_share is not None and self.merge == "calib")
        return fitted or self.kv_share_select == "calib" or self.global_select == "calib"

    @property
    def needs_calibration(self) -> bool:
        return self.needs_attention_inputs or (self.streams and self.streaming_set is None)

    @property
    def calibration(self) -> CalibrationSpec:
        """The calibration text and windows the rewrites fit on."""
        return CalibrationSpec(source=self.calib or DEFAULT_CALIB, num_samples=self.calib_seqs,
                               seq_len=self.calib_seq_len)

    @property
    def streaming_calibration(self) -> CalibrationSpec:
        """The windows streaming heads are scored on: longer than the window by 512 tokens at least."""
        return replace(self.calibration, seq_len=max(self.calib_seq_len, (self.sliding_window or 0) + 512))


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    before: AttentionLayout
    after: AttentionLayout
    calibration: str | None  # what the calibration used, e.g. "2 x 1024 tokens of wikipedia:calib"


def validate(spec: ConvertSpec, config: dict) -> AttentionLayout:
    """Raise a one-line ``KvslimError`` for any request the model cannot take; return its layout."""
    if config.get("quantization_config"):
        raise KvslimError("checkpoint is quantized; convert works on unquantized weights: convert first, then quantize")
    model_type = model_type_of(config)
    layout = AttentionLayout.from_config(config)
    n_layers, n_heads, n_kv = layout.num_layers, layout.num_heads, layout.num_kv_heads
    if spec.streams:
        _validate_streaming(spec, config, layout)
    if spec.kv_heads is None and spec.kv_share is None and spec.sliding_window is None and not spec.sinks:
        raise KvslimError("nothing to convert: pass --kv-heads N / --mqa, --kv-share K, --sliding-window W, --sinks S "
                          "or --streaming-heads F")
    if spec.sinks < 0:
        raise KvslimError(f"--sinks {spec.sinks} must be 0 or more")
    if spec.sinks and spec.sliding_window is None and not layout.sliding_layers():
        raise KvslimError("--sinks needs --sliding-window W (the model has no sliding layers)")
    if spec.sinks and any(l.sinks for l in layout.layers):
        raise KvslimError("--sinks conflicts with the model's existing attention sinks")
    if spec.sinks and model_type not in CAUSAL_LM_CLASSES:
        raise UnsupportedArchitecture(f"--sinks is not supported for model_type {model_type} (no kvslim modeling file)")
    if spec.kv_heads is not None:
        n = spec.kv_heads
        if n < 1 or n_heads % n:
            raise KvslimError(f"--kv-heads {n} does not divide the model's {n_heads} attention heads")
        if n >= n_kv or n_kv % n:
            raise KvslimError(f"--kv-heads {n} conflicts with the model's {n_kv} KV heads (must be a smaller divisor of {n_kv})")
        if spec.merge not in gqa.MERGE_METHODS:
            raise KvslimError(f"--merge {spec.merge}: expected one of {', '.join(gqa.MERGE_METHODS)}")
    if spec.kv_share is not None:
        if not 2 <= spec.kv_share <= n_layers:
            raise KvslimError(f"--kv-share {spec.kv_share} must be between 2 (groups of 1 share nothing) and the "
                              f"model's {n_layers} layers")
        if KV_SOURCE_KEY in config:
            raise KvslimError(f"--kv-share conflicts with the model's existing {KV_SOURCE_KEY}")
        if model_type not in KV_SHARING_TYPES:
            raise UnsupportedArchitecture(f"--kv-share is not supported for model_type {model_type}")
    if spec.sliding_window is not None:
        w, context = spec.sliding_window, int(config.get("max_position_embeddings") or 0)
        # Heads given by the caller may take the whole context as their window (KV bits per head:
        # eval.kv_precision_heads); a user's window must be shorter than that.
        longest = context if spec.streaming_set is not None and not spec.sinks else context - 1
        if w < 1 or (context and w > longest):
            raise KvslimError(f"--sliding-window {w} must be at least 1 and below the model's context ({context})")
        if layout.sliding_layers() and not spec.streams:
            raise KvslimError("--sliding-window conflicts with the model's existing sliding-window layers")
        if (spec.global_every is None) == (spec.global_layers is None) and not spec.streams:
            raise KvslimError("--sliding-window needs exactly one of --global-every G or --global-layers i,j,...")
        if spec.global_every is not None and not 1 <= spec.global_every <= n_layers:
            raise KvslimError(f"--global-every {spec.global_every} must be between 1 and the model's {n_layers} layers")
        if spec.global_layers is not None:
            bad = [i for i in spec.global_layers if not 0 <= i < n_layers]
            if bad or len(set(spec.global_layers)) != len(spec.global_layers):
                raise KvslimError(f"--global-layers {list(spec.global_layers)}: need distinct layers in [0, {n_layers})")
    elif spec.global_every is not None or spec.global_layers is not None:
        raise KvslimError("--global-every / --global-layers need --sliding-window")
    if spec.kv_share_select != "first" and spec.kv_share is None:
        raise KvslimError(f"--kv-share-select {spec.kv_share_select} needs --kv-share K")
    if spec.global_select != "fixed" and spec.sliding_window is None:
        raise KvslimError(f"--global-select {spec.global_select} needs --sliding-window W")
    if spec.calib is not None and not spec.needs_calibration:
        raise KvslimError("--calib is given but nothing here reads calibration text (it is read by --kv-heads/--mqa "
                          "with --merge calib or aligned, --kv-share with --merge calib, --kv-share-select calib, "
                          "--global-select calib, --streaming-heads unless the heads are given)")
    return layout


def _validate_streaming(spec: ConvertSpec, config: dict, layout: AttentionLayout) -> None:
    model_type = model_type_of(config)
    if spec.sliding_window is None:
        raise KvslimError("--streaming-heads needs --sliding-window W (the window the streaming heads see)")
    if spec.global_every is not None or spec.global_layers is not None:
        raise KvslimError("--streaming-heads chooses heads in every layer; drop --global-every / --global-layers")
    if spec.kv_heads is not None or spec.kv_share is not None:
        raise KvslimError("--streaming-heads scores the checkpoint's own heads: merge or share KV first, then "
                          "convert that checkpoint with --streaming-heads")
    if model_type not in STREAMING_TYPES:
        raise UnsupportedArchitecture(f"--streaming-heads is not supported for model_type {model_type} "
                                      f"(supported: {', '.join(STREAMING_TYPES)})")
    if layout.streaming_layers() or len(layout.cache_owners()) != layout.num_layers:
        raise KvslimError("--streaming-heads needs a checkpoint without KV sharing or streaming heads")
    if len(layout.sliding_layers()) == layout.num_layers:
        raise KvslimError("--streaming-heads streams heads of full-attention layers; every layer here is sliding")
    f = spec.streaming_heads
    if f is not None and f != "auto" and not (isinstance(f, float) and 0.0 <= f <= 1.0):
        raise KvslimError(f"--streaming-heads {f}: expected a fraction of the KV heads in [0, 1] or auto")
    if spec.streaming_select not in STREAMING_SELECTS:
        raise KvslimError(f"--streaming-select {spec.streaming_select}: expected one of {', '.join(STREAMING_SELECTS)}")
    if spec.streaming_set is not None and (len(spec.streaming_set) != layout.num_layers or any(
            not all(0 <= h < layout.num_kv_heads for h in hs) for hs in spec.streaming_set)):
        raise KvslimError(f"streaming heads: need one list of KV heads in [0, {layout.num_kv_heads}) per layer")
    if spec.streaming_set is not None and any(spec.streaming_set[i] for i in layout.sliding_layers()):
        raise KvslimError("streaming heads: only full-attention layers have heads to stream")


def choose_streaming_heads(ckpt: Checkpoint, spec: ConvertSpec) -> tuple[tuple[int, ...], ...]:
    """Per layer, the KV heads that stream: ``spec.streaming_set``, or the lowest-scored fraction."""
    from transformers import AutoModelForCausalLM

    if spec.streaming_set is not None:
        return spec.streaming_set
    layout = AttentionLayout.from_config(ckpt.config)
    fraction = spec.streaming_heads
    if fraction == "auto":
        fraction = auto_fraction(layout.num_heads, layout.num_kv_heads)
    ids = calibration_ids(ckpt.path, spec.streaming_calibration)
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    scores = head_scores(model, ids, spec.sliding_window, spec.sinks)
    full_layers = [i for i, l in enumerate(layout.layers) if l.kind == "full"]
    return streaming_kv_heads(scores[spec.streaming_select], fraction, full_layers)


def calibrate(ckpt: Checkpoint, spec: ConvertSpec) -> AttentionInputs:
    """Capture the original model's attention inputs (and far attention mass, if needed)."""
    from transformers import AutoModelForCausalLM

    window = spec.sliding_window if spec.global_select == "calib" else None
    calibration = spec.calibration
    ids = calibration_ids(ckpt.path, calibration)
    model = AutoModelForCausalLM.from_pretrained(
        ckpt.path, dtype=torch.float32, attn_implementation="eager" if window else "sdpa"
    ).eval()
    return capture_attention_inputs(model, ids, calibration.source, window=window)


def rewrite(
    weights: dict[str, torch.Tensor], config: dict, spec: ConvertSpec, calib: AttentionInputs | None,
    streaming: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Apply the rewrites to in-memory weights and config; return the new ones. ``streaming``:
    per layer, the KV heads that stream (``choose_streaming_heads``)."""
    config = dict(config)
    if streaming is not None:
        config[STREAMING_KEY] = {"window": spec.sliding_window, "sinks": spec.sinks,
                                 "kv_heads": [list(hs) for hs in streaming]}
        layout = AttentionLayout.from_config(config)
        config.update(layout.config_updates())
        config["auto_map"] = auto_map_for(config["model_type"])
        return weights, config
    n_layers = int(config["num_hidden_layers"])
    if spec.kv_heads is not None:
        weights = gqa.merge_kv_heads(weights, config, spec.kv_heads, spec.merge, calib)
        config["num_key_value_heads"] = spec.kv_heads
    kinds = ["full"] * n_layers
    if spec.sliding_window is not None:
        types = sliding.hybrid_layer_types(n_layers, spec.global_every, spec.global_layers, spec.global_select, calib)
        kinds = ["sliding" if t == sliding.SLIDING else "full" for t in types]
        config.update(sliding_window=spec.sliding_window, layer_types=types)
        if config["model_type"] in ("qwen2", "qwen3"):
            config["use_sliding_window"] = True
    if spec.kv_share is not None:
        fit = "calib" if spec.merge == "calib" else "none"
        sources = kv_sharing.choose_suppliers(weights, config, spec.kv_share, spec.kv_share_select, fit, calib, kinds)
        weights = kv_sharing.share_kv(weights, config, sources, fit, calib)
        config[KV_SOURCE_KEY] = sources
    if spec.sinks:
        config[SINKS_KEY] = spec.sinks
    layout = AttentionLayout.from_config(config)  # re-validates the combination
    config.update(layout.config_updates())
    hybrid_needs_ours = spec.sliding_window is not None and config["model_type"] not in NATIVE_HYBRID
    if spec.kv_share is not None or hybrid_needs_ours or spec.sinks:
        config["auto_map"] = auto_map_for(config["model_type"])
    return weights, config


def convert(
    model_dir: Path, spec: ConvertSpec, out: Path, force: bool = False, calib: AttentionInputs | None = None,
    extra_files: dict[str, str] | None = None,
) -> ConvertResult:
    """Rewrite ``model_dir`` per ``spec`` into a new checkpoint at ``out`` (atomically).

    ``calib``: attention inputs captured earlier from the same model (benchmarks reuse one
    capture for several rewrites); captured here when the spec needs them and none is given.
    ``extra_files``: name -> text written into the checkpoint with it (the KV plan).
    """
    ckpt = Checkpoint.open(model_dir)
    before = validate(spec, ckpt.config)
    check_output_dir(Path(out), force)
    if spec.global_select == "calib" and spec.calib_seq_len <= (spec.sliding_window or 0):
        spec = replace(spec, calib_seq_len=spec.sliding_window + 512)
    if calib is None and spec.needs_attention_inputs:
        calib = calibrate(ckpt, spec)
    streaming = choose_streaming_heads(ckpt, spec) if spec.streams else None
    if spec.sliding_window is not None and spec.global_select == "calib" and calib.window != spec.sliding_window:
        raise KvslimError(f"calibration measured attention beyond window {calib.window}, not {spec.sliding_window}")
    weights = dict(ckpt.iter_tensors())
    weights, config = rewrite(weights, ckpt.config, spec, calib, streaming)
    with atomic_output_dir(out, force) as tmp:
        writer = ShardWriter(tmp)
        for name, tensor in weights.items():
            writer.add(name, tensor)
        writer.close()
        ckpt.copy_side_files(tmp, kv_plan=False)  # a KV plan describes the layout it was made for
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if "auto_map" in config:
            write_modeling_file(tmp)
        write_config(tmp, config)
    described = calib.describe() if calib else None
    if streaming is not None and spec.streaming_set is None:
        c = spec.streaming_calibration
        described = f"{c.num_samples} x {c.seq_len} tokens of {c.source} (head scores: {spec.streaming_select})"
    return ConvertResult(Path(out), before, AttentionLayout.from_config(config), described)
