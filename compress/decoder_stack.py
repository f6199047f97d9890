"""A causal LM's decoder layers, materialised one at a time from transformers' own modules.

The model is instantiated on the ``meta`` device from its config (no memory), the embedding and
final norm are materialised once, and each decoder layer is materialised from the checkpoint only
while it runs. ``LazyDecoderStack`` is the streaming path (a checkpoint directory);
``ResidentDecoderStack`` wraps a model already in memory, the reference the streaming path is
tested against, byte for byte.
"""
from __future__ import annotations

import copy
import re
from typing import Protocol

import torch
from torch import nn

from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError

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
