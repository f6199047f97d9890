"""Run a causal LM one decoder layer at a time over calibration tokens.

transformers' own modules do the arithmetic: the model is instantiated on the ``meta`` device
from its config (no memory), the embedding and final norm are materialised once, and each
decoder layer is materialised from the checkpoint only while it runs. The arguments the model
passes to every decoder layer (attention mask, rotary position embeddings, ...) are recorded by
running the model's own forward with the layers replaced by recorders, so hybrid layouts
(Gemma 3's sliding and global layers) get exactly what transformers would give them.

Memory is bounded by one layer's weights, the Hessians of its Linears and the calibration
activations (``num_samples x seq_len x hidden``), never by the model.

``DecoderStack`` has two implementations: ``LazyDecoderStack`` (the streaming path, reading a
checkpoint directory) and ``ResidentDecoderStack`` (a model already in memory; the in-memory
reference the streaming path is tested against, byte for byte).
"""
from __future__ import annotations

import copy
import inspect
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from compress.activation_quant import LinearInputQuantizer, activation_fake_quantizer
from compress.algorithms.gptq import DEFAULT_SINK_WEIGHT
from compress.checkpoint import Checkpoint
from compress.errors import KvslimError
from compress.schemes import ActivationQuant, QuantScheme

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_LAYER = re.compile(r"^(.*\.layers)\.(\d+)\.(.+)$")


def layer_of_module(module: str) -> int | None:
    """Decoder-layer index of a module name (``model.layers.3.mlp.up_proj`` -> 3), else None."""
    m = _LAYER.match(module)
    return int(m.group(2)) if m else None


class DecoderStack(Protocol):
    """A causal LM's decoder layers, materialised one at a time."""

    base: nn.Module  # the decoder (``model.model``): embeddings, layers, final norm
    num_layers: int
    dtype: torch.dtype

    def layer_prefix(self, i: int) -> str: ...

    def load_layer(self, i: int, overrides: dict[str, torch.Tensor]) -> nn.Module:
        """Layer ``i`` ready to run, with ``overrides`` (``{module: weight}``, full module
        names) replacing those Linears' weights."""
        ...

    def unload_layer(self, i: int, layer: nn.Module) -> None: ...

    def release_embedding(self) -> None:
        """The token embedding is no longer needed (every batch's layer-0 inputs exist)."""
        ...


def _qualified_names(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


class LazyDecoderStack:
    """Decoder layers read lazily from a checkpoint directory into a meta-device skeleton."""

    def __init__(self, ckpt: Checkpoint) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.ckpt = ckpt
        sources = ckpt.config.get("kv_source_layers")
        if sources is not None and list(sources) != list(range(len(sources))):
            raise KvslimError(
                f"{ckpt.path} shares KV across layers (kv_source_layers); calibration (GPTQ, --smooth, "
                "--kv-cache-fp8) runs transformers' own decoder layers, which cannot: quantize it with RTN, "
                "or calibrate the unconverted model"
            )
        config = AutoConfig.from_pretrained(ckpt.path)
        self.dtype = _checkpoint_dtype(ckpt)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation="sdpa")
        self.base = self.model.base_model
        self.num_layers = len(self.base.layers)
        names = _qualified_names(self.model)
        self._prefixes = [names[id(layer)] for layer in self.base.layers]
        for child_name, child in self.base.named_children():
            if child_name != "layers":
                self._materialise(child, names[id(child)])

    def _materialise(self, module: nn.Module, prefix: str, overrides: dict[str, torch.Tensor] | None = None) -> None:
        """Allocate ``module`` on the CPU, re-initialise its non-persistent buffers (rotary
        frequencies) with transformers' own ``_init_weights`` and load its parameters."""
        module.to_empty(device="cpu")
        for sub in module.modules():
            if any(True for _ in sub.buffers(recurse=False)):
                self.model._init_weights(sub)
        overrides = overrides or {}
        state = {}
        for key in module.state_dict():
            full = f"{prefix}.{key}"
            mod_name = full.removesuffix(".weight")
            if full.endswith(".weight") and mod_name in overrides:
                state[key] = overrides[mod_name].to(self.dtype)
            elif self.ckpt.has(full):
                state[key] = self.ckpt.get(full).to(self.dtype)
            else:
                raise KvslimError(f"{self.ckpt.path}: missing tensor {full}")
        module.load_state_dict(state, strict=True, assign=True)

    def layer_prefix(self, i: int) -> str:
        return self._prefixes[i]

    def load_layer(self, i: int, overrides: dict[str, torch.Tensor]) -> nn.Module:
        layer = copy.deepcopy(self.base.layers[i])  # a meta-device copy: free
        self._materialise(layer, self._prefixes[i], overrides)
        return layer

    def unload_layer(self, i: int, layer: nn.Module) -> None:
        layer.to("meta")

    def release_embedding(self) -> None:
        self.base.get_input_embeddings().to("meta")


class ResidentDecoderStack:
    """Decoder layers of a transformers model already loaded in memory (the reference path)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.base = model.base_model
        self.num_layers = len(self.base.layers)
        self.dtype = next(model.parameters()).dtype
        names = _qualified_names(model)
        self._prefixes = [names[id(layer)] for layer in self.base.layers]

    def layer_prefix(self, i: int) -> str:
        return self._prefixes[i]

    def load_layer(self, i: int, overrides: dict[str, torch.Tensor]) -> nn.Module:
        layer = self.base.layers[i]
        prefix = self._prefixes[i] + "."
        for name, module in layer.named_modules():
            full = prefix + name
            if full in overrides:
                module.weight = nn.Parameter(overrides[full].to(self.dtype), requires_grad=False)
        return layer

    def unload_layer(self, i: int, layer: nn.Module) -> None:
        pass

    def release_embedding(self) -> None:
        pass


def _checkpoint_dtype(ckpt: Checkpoint) -> torch.dtype:
    for name, (dtype, shape) in ckpt.headers.items():
        if name.endswith("_proj.weight") and len(shape) == 2:
            if dtype not in _DTYPES:
                raise KvslimError(f"{ckpt.path}: {name} has dtype {dtype}; expected F32, BF16 or F16")
            return _DTYPES[dtype]
    raise KvslimError(f"{ckpt.path}: no projection weights found")


class _Recorder(nn.Module):
    """Stands in for a decoder layer: records the arguments it gets, returns its input."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.calls.append((hidden_states, args, kwargs))
        return hidden_states


def _cache_keyword(layer: nn.Module, recorded: dict) -> str:
    """The name under which ``layer`` takes its KV cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (before). Passing the other name is ignored with a warning by the newer
    layers' deprecation shim, so the KV-scale observer would see nothing."""
    for name in ("cache", "past_key_values"):
        if name in recorded:
            return name
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class _Batch:
    hidden: torch.Tensor  # inputs of the current layer [b, seq, hidden]
    layer_args: list[tuple[tuple, dict]]  # per layer: the extra args transformers passes


# Weight of each calibration window's first token in the Hessians. Windows start mid-text, and
# the first token becomes an attention sink (massive activations, read by every later token's
# attention). Plain GPTQ weighs it as 1/seq_len of the data and trades its accuracy away: on
# SmolLM2-135M INT4 g32 (8 x 512 calibration tokens, wikipedia:eval first 2048 tokens) perplexity
# was 19.19 with weight 1 vs RTN 18.48; 28.7 without the token; 18.00 with 16; 18.23 with 128.
# That check read evaluation text; re-chosen on held-out calibration text only (wikipedia:calib
# after the 64 calibration windows), 16 still beats 1 (16.39 vs 17.26).
SINK_WEIGHT = DEFAULT_SINK_WEIGHT


class HessianCollector:
    """Forward hooks accumulating ``2/n X^T X`` (fp32) for every Linear of one layer.

    Linears that read the same input tensor (q/k/v, gate/up) share one accumulator. Position 0
    of every sequence counts ``sink_weight`` times (see ``SINK_WEIGHT``).
    """

    def __init__(self, layer: nn.Module, prefix: str, sink_weight: float = SINK_WEIGHT) -> None:
        self._sink_scale = sink_weight**0.5
        self._sums: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self.alias: dict[str, str] = {}  # module -> module owning its accumulator
        self._seen: list[tuple[torch.Tensor, str]] = []
        self._handles = [
            m.register_forward_hook(self._hook(f"{prefix}.{n}"))
            for n, m in layer.named_modules() if isinstance(m, nn.Linear)
        ]

    def _hook(self, name: str) -> Callable:
        def hook(module, inputs, output) -> None:
            x = inputs[0]
            if name not in self.alias:
                owner = next((o for t, o in self._seen if t is x), name)
                self.alias[name] = owner
            self._seen.append((x, name))
            owner = self.alias[name]
            if owner != name:
                return
            x = x.to(torch.float32)
            if self._sink_scale != 1.0 and x.dim() == 3:
                x = x.clone()
                x[:, 0] *= self._sink_scale
            flat = x.reshape(-1, x.shape[-1])
            if name not in self._sums:
                self._sums[name] = torch.zeros(flat.shape[1], flat.shape[1])
                self._rows[name] = 0
            self._sums[name].addmm_(flat.t(), flat)
            self._rows[name] += flat.shape[0]

        return hook

    def end_batch(self) -> None:
        self._seen.clear()

    def close(self) -> dict[str, torch.Tensor]:
        """Remove the hooks; ``{owner module: H}`` (scaled by 2/n), plus ``alias``."""
        for h in self._handles:
            h.remove()
        for name, s in self._sums.items():
            s.mul_(2.0 / self._rows[name])
        return self._sums


class LayerStream:
    """Calibration activations pushed through the model one decoder layer at a time.

    ``hessians(i)`` runs layer ``i`` (original weights) and returns its Linears' input Hessians;
    ``advance(i, overrides)`` runs layer ``i`` with (quantized) weights and keeps its outputs as
    the next layer's inputs (GPTQ's sequential scheme: each layer calibrates on the outputs of the
    already-quantized layers before it).

    ``activations``: the quantize-dequantize a runtime applies to every Linear's input (FP8_DYNAMIC,
    W8A8), applied here too, so each layer calibrates on the inputs it will be served.
    """

    def __init__(
        self, stack: DecoderStack, calib_ids: torch.Tensor, batch_tokens: int = 2048,
        activations: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.stack = stack
        self.activations = activations
        self.next_layer = 0
        n, seq = calib_ids.shape
        per_batch = max(1, batch_tokens // seq)
        self.batches: list[_Batch] = []
        with torch.no_grad():
            for chunk in calib_ids.split(per_batch):
                self.batches.append(self._record(chunk))
        stack.release_embedding()

    def _record(self, ids: torch.Tensor) -> _Batch:
        base = self.stack.base
        calls: list = []
        real_layers = base.layers
        base.layers = nn.ModuleList([_Recorder(calls) for _ in range(len(real_layers))])
        try:
            base(input_ids=ids, use_cache=False)
        finally:
            base.layers = real_layers
        if len(calls) != self.stack.num_layers:
            raise KvslimError(f"the model ran {len(calls)} of its {self.stack.num_layers} decoder layers")
        hidden = calls[0][0]
        return _Batch(hidden, [(args, kwargs) for _, args, kwargs in calls])

    def _run(self, i: int, layer: nn.Module, batch: _Batch, cache=None) -> torch.Tensor:
        args, kwargs = batch.layer_args[i]
        if cache is not None:
            kwargs = dict(kwargs, **{_cache_keyword(layer, kwargs): cache})
        with LinearInputQuantizer(layer, self.activations) if self.activations is not None else nullcontext():
            out = layer(batch.hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def hessians(self, i: int, sink_weight: float = SINK_WEIGHT) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Input Hessians of layer ``i``'s Linears: ``({owner: H}, {module: owner})``."""
        self._check(i)
        layer = self.stack.load_layer(i, {})
        collector = HessianCollector(layer, self.stack.layer_prefix(i), sink_weight)
        for batch in self.batches:
            self._run(i, layer, batch)
            collector.end_batch()
        hessians = collector.close()
        self.stack.unload_layer(i, layer)
        return hessians, collector.alias

    @torch.no_grad()
    def advance(self, i: int, overrides: dict[str, torch.Tensor], cache=None) -> None:
        """Run layer ``i`` with ``overrides`` and make its outputs the next layer's inputs.

        ``cache``: an object with transformers' ``Cache.update`` signature, given every layer's
        post-rotary keys and values (the KV-scale observer)."""
        self._advance(i, overrides, cache)

    def _advance(self, i: int, overrides: dict[str, torch.Tensor], cache=None,
                 observe: Callable[[nn.Module], list] | None = None) -> None:
        """``advance``, with ``observe(layer)``'s hook handles in place while the layer runs."""
        self._check(i)
        layer = self.stack.load_layer(i, overrides)
        handles = observe(layer) if observe is not None else []
        try:
            for batch in self.batches:
                batch.hidden = self._run(i, layer, batch, cache)
        finally:
            for h in handles:
                h.remove()
        self.stack.unload_layer(i, layer)
        self.next_layer = i + 1

    @torch.no_grad()
    def input_maxima(self, i: int) -> dict[str, torch.Tensor]:
        """Run layer ``i`` (its own weights) like ``advance`` and return every Linear's per-input-
        channel ``max |x|`` (fp32) over the calibration tokens: ``{module: [in_features]}``."""
        prefix = self.stack.layer_prefix(i)
        maxima: dict[str, torch.Tensor] = {}
        last: list = [None, None]  # (input, its maxima): q/k/v and gate/up read one tensor

        def hook(name: str) -> Callable:
            def record(module, inputs) -> None:
                x = inputs[0]
                if x is not last[0]:
                    last[:] = [x, x.detach().abs().flatten(0, -2).amax(0).float()]
                m = last[1]
                maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m
            return record

        def observe(layer: nn.Module) -> list:
            return [m.register_forward_pre_hook(hook(f"{prefix}.{n}"))
                    for n, m in layer.named_modules() if isinstance(m, nn.Linear)]

        self._advance(i, {}, observe=observe)
        return maxima

    @torch.no_grad()
    def final_hidden(self) -> list[torch.Tensor]:
        """The final norm of the last layer's outputs (the inputs of ``lm_head``)."""
        if self.next_layer != self.stack.num_layers:
            raise RuntimeError("final_hidden before the last layer ran")
        return [self.stack.base.norm(b.hidden) for b in self.batches]

    def _check(self, i: int) -> None:
        if i != self.next_layer:
            raise RuntimeError(f"layer {i} requested but the stream holds inputs of layer {self.next_layer}")


def open_stack(source: str | Path) -> LazyDecoderStack:
    return LazyDecoderStack(Checkpoint.open(source))


class SequentialQuantizer:
    """A ``WeightQuantizer`` that calibrates layer by layer through a ``LayerStream``.

    The streaming driver asks for the Linears of layer 0, then layer 1, ... (non-layer Linears
    last). The first time a layer is asked for, the previous layers are run with their
    quantized weights (``advance``) and, for GPTQ, the layer's input Hessians are captured. With
    ``kv_observer`` the advance passes also record post-rotary K/V maxima; ``finish`` runs the
    remaining layers and returns the KV-scale tensors.
    """

    def __init__(self, stream: LayerStream, method: str, options=None, kv_observer=None) -> None:
        from compress.algorithms.gptq import GPTQOptions

        if method not in ("rtn", "gptq"):
            raise KvslimError(f"unknown quantization method {method!r} (rtn or gptq)")
        self.name = method
        self.stream = stream
        self.options = options or GPTQOptions()
        self.kv_observer = kv_observer
        self._layer: int | None = None  # layer whose Linears are being quantized
        # The current layer's quantized Linears, kept as stored (packed) until the layer is run
        # with them: {module: (tensors, scheme, weight dtype)}. Dequantized copies of six
        # Linears would cost ~300 MB at 7B while the last one's Hessian is inverted.
        self._quantized: dict[str, tuple[dict[str, torch.Tensor], QuantScheme, torch.dtype]] = {}
        self._hessians: dict[str, torch.Tensor] = {}
        self._alias: dict[str, str] = {}
        self.losses: dict[str, float] = {}

    def _advance_to(self, target: int) -> None:
        """Run layers until the stream holds the inputs of layer ``target``."""
        while self.stream.next_layer < target:
            i = self.stream.next_layer
            overrides = self._dequantized_layer() if i == self._layer else {}
            self.stream.advance(i, overrides, self.kv_observer)
            del overrides
            if i == self._layer:
                self._quantized = {}

    def _dequantized_layer(self) -> dict[str, torch.Tensor]:
        """``{module: weight}`` of the current layer's quantized Linears, as a loader decodes them."""
        from compress.primitives import dequantize_linear

        return {m: dequantize_linear(t, s).to(dtype) for m, (t, s, dtype) in self._quantized.items()}

    def _enter(self, layer: int | None) -> None:
        num_layers = self.stream.stack.num_layers
        target = num_layers if layer is None else layer
        if layer is not None and self._layer is not None and layer < self._layer:
            raise RuntimeError(f"layer {layer} requested after layer {self._layer}")
        self._advance_to(target)
        self._layer = layer
        self._hessians, self._alias = {}, {}
        if self.name != "gptq":
            return
        if layer is None:
            xs = self.stream.final_hidden()
            h = None
            rows = 0
            for x in xs:
                flat = x.reshape(-1, x.shape[-1]).to(torch.float32)
                h = flat.t() @ flat if h is None else h.addmm_(flat.t(), flat)
                rows += flat.shape[0]
            self._hessians = {"lm_head": h.mul_(2.0 / rows)}
            self._alias = {"lm_head": "lm_head"}
        else:
            self._hessians, self._alias = self.stream.hessians(layer, self.options.sink_weight)

    def _take_hessian(self, module: str) -> torch.Tensor:
        owner = self._alias.get(module)
        if owner is None or owner not in self._hessians:
            raise KvslimError(f"no calibration inputs reached {module}")
        sharers = [m for m, o in self._alias.items() if o == owner and m != module]
        self._alias.pop(module)
        if sharers:
            return self._hessians[owner].clone()
        return self._hessians.pop(owner)

    def quantize(self, module: str, weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        from compress.algorithms.gptq import gptq_quantize
        from compress.algorithms.rtn import RTN

        layer = layer_of_module(module)
        if layer != self._layer or (layer is None and self.stream.next_layer < self.stream.stack.num_layers):
            self._enter(layer)
        if self.name == "gptq":
            result = gptq_quantize(weight, self._take_hessian(module), scheme, self.options)
            self.losses[module] = result.loss
            tensors = result.tensors  # decodes exactly to result.dequantized (tests/compress/test_gptq.py)
            del result
        else:
            tensors = RTN().quantize(module, weight, scheme)
        if layer is not None:
            self._quantized[module] = (tensors, scheme, weight.dtype)
        return tensors

    def finish(self) -> dict[str, torch.Tensor]:
        """Extra tensors to write after the last Linear: the KV-cache scales, if observed."""
        if self.kv_observer is None:
            return {}
        from compress.kv_scales import kv_scale_tensors

        if self._layer is not None or self.stream.next_layer < self.stream.stack.num_layers:
            self._advance_to(self.stream.stack.num_layers)
        stack = self.stream.stack
        unseen = [i for i in range(stack.num_layers) if i not in self.kv_observer.layers()]
        if unseen:
            raise KvslimError(
                f"the KV-scale observer saw no cache write from {len(unseen)} of {stack.num_layers} layers "
                f"(first: layer {unseen[0]}); this transformers version's decoder layer does not call the cache "
                "it was given"
            )
        prefixes = {i: f"{stack.layer_prefix(i)}.self_attn" for i in range(stack.num_layers)}
        return kv_scale_tensors(self.kv_observer, prefixes, stack.dtype)


def calibrated_quantizer(
    source: str | Path, method: str, calib, options=None, kv_cache_fp8: bool = False, batch_tokens: int = 2048,
    activations: ActivationQuant | None = None,
) -> SequentialQuantizer:
    """A ``SequentialQuantizer`` over ``source`` (a checkpoint dir) calibrated on ``calib``
    (a ``CalibrationSpec``); raises ``KvslimError`` on bad calibration input before any work.

    ``activations``: the scheme's ``ActivationQuant`` (FP8_DYNAMIC, W8A8), applied to every
    Linear's input during calibration as the runtime applies it when serving."""
    from compress.calibration import calibration_ids

    calib.check()
    ids = calibration_ids(Checkpoint.open(source).path, calib)
    return windows_quantizer(source, method, ids, options, kv_cache_fp8, batch_tokens, activations)


def windows_quantizer(
    source: str | Path | Checkpoint, method: str, ids: torch.Tensor, options=None, kv_cache_fp8: bool = False,
    batch_tokens: int = 2048, activations: ActivationQuant | None = None,
) -> SequentialQuantizer:
    """``calibrated_quantizer`` on token windows ``ids [num_samples, seq_len]`` already cut."""
    from compress.calibration import check_ids_in_vocab
    from compress.kv_scales import KVScaleObserver

    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    check_ids_in_vocab(ids, ckpt.config, ckpt.path)
    stream = LayerStream(LazyDecoderStack(ckpt), ids, batch_tokens=batch_tokens,
                         activations=activation_fake_quantizer(activations))
    return SequentialQuantizer(stream, method, options, KVScaleObserver() if kv_cache_fp8 else None)
