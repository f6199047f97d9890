"""Run a causal LM one decoder layer at a time over calibration tokens.

The arguments the model passes to every decoder layer (attention mask, rotary position
embeddings, ...) are recorded by running the model's own forward with the layers replaced by
recorders, so hybrid layouts (Gemma 3's sliding and global layers) get exactly what transformers
would give them. Memory is bounded by one layer's weights, the Hessians of its Linears and the
calibration activations (``num_samples x seq_len x hidden``), never by the model.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from compress.algorithms.gptq import DEFAULT_SINK_WEIGHT
from compress.decoder_stack import DecoderStack
from foundation.activation_quant import LinearInputQuantizer
from foundation.errors import KvslimError


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
