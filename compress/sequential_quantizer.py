"""GPTQ / RTN with calibration, layer by layer: a ``WeightQuantizer`` over a ``LayerStream``."""
from __future__ import annotations

from pathlib import Path

import torch

from compress.decoder_stack import LazyDecoderStack, layer_of_module
from compress.layer_stream import LayerStream
from foundation.activation_quant import activation_fake_quantizer
from foundation.calibration import calibration_ids, check_ids_in_vocab
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.schemes import ActivationQuant, QuantScheme


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
        from foundation.primitives import dequantize_linear

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
        seen = set(self.kv_observer.layers())
        unseen = [i for i in range(stack.num_layers) if i not in seen]
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
    calib.check()
    ids = calibration_ids(Checkpoint.open(source).path, calib)
    return windows_quantizer(source, method, ids, options, kv_cache_fp8, batch_tokens, activations)


def windows_quantizer(
    source: str | Path | Checkpoint, method: str, ids: torch.Tensor, options=None, kv_cache_fp8: bool = False,
    batch_tokens: int = 2048, activations: ActivationQuant | None = None,
) -> SequentialQuantizer:
    """``calibrated_quantizer`` on token windows ``ids [num_samples, seq_len]`` already cut."""
    from compress.kv_scales import KVScaleObserver

    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(source)
    check_ids_in_vocab(ids, ckpt.config, ckpt.path)
    stream = LayerStream(LazyDecoderStack(ckpt), ids, batch_tokens=batch_tokens,
                         activations=activation_fake_quantizer(activations))
    return SequentialQuantizer(stream, method, options, KVScaleObserver() if kv_cache_fp8 else None)
