"""transformers' ``QuantizedCache`` as ``kv_quant_peer.py`` runs it: KIVI axes per backend, the
bytes a cache allocates (codes, scales and shifts, full-precision residual; counted per storage),
and a window fed in forward calls with one cache carried over. The axes and the call protocol are
described in ``kv_quant_peer.py``'s docstring."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

# (axis_key, axis_value) for KIVI's layout, keys per channel and values per token. quanto's are checked
# (module docstring); hqq's are the values transformers accepts for it, not checked here.
KIVI_AXES = {"quanto": (-1, 0), "hqq": (0, 1)}
BACKEND_MODULE = {"quanto": "optimum.quanto", "hqq": "hqq"}


@dataclass
class CacheBytes:
    """Storage of one transformers cache, all layers."""

    codes: int = 0
    params: int = 0  # scales and shifts
    residual: int = 0  # full-precision K/V (all of a DynamicCache)
    tokens: int = 0
    quantized_tokens: int = 0

    @property
    def per_token(self) -> float:
        return (self.codes + self.params + self.residual) / self.tokens

    @property
    def per_quantized_token(self) -> float | None:
        return (self.codes + self.params) / self.quantized_tokens if self.quantized_tokens else None


def _leaves(obj, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """Plain tensors under a backend's quantized state, each with the attribute name it hangs off
    (a quanto QTensor nests ``_data`` (a PackedTensor with its own ``_data``), ``_scale``, ``_shift``)."""
    if isinstance(obj, torch.Tensor) and type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        return [leaf for inner in obj.__tensor_flatten__()[0] for leaf in _leaves(getattr(obj, inner), name or inner)]
    if isinstance(obj, torch.Tensor):
        return [(name, obj)]
    if isinstance(obj, (tuple, list)):  # hqq: (codes, meta)
        return [leaf for i, o in enumerate(obj) for leaf in _leaves(o, name or ("_data" if i == 0 else "meta"))]
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, name or k)]
    return []


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def cache_bytes(cache) -> CacheBytes:
    """Allocated bytes of a transformers cache: quantized codes, their scales and shifts, and the
    full-precision residual, counted once per storage."""
    from transformers.cache_utils import QuantizedLayer

    out, seen = CacheBytes(), set()
    for layer in cache.layers:
        out.residual += _storage_bytes([t for t in (layer.keys, layer.values) if t is not None and t.numel()], seen)
        held = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
        if isinstance(layer, QuantizedLayer):
            leaves = _leaves(layer._quantized_keys) + _leaves(layer._quantized_values)
            out.codes += _storage_bytes([t for n, t in leaves if n == "_data"], seen)
            out.params += _storage_bytes([t for n, t in leaves if n != "_data"], seen)
            out.tokens = layer.get_seq_length()
            out.quantized_tokens = out.tokens - held
        else:
            out.tokens = held
    return out


def window_chunks(n: int, first: int, chunk: int) -> list[int]:
    """Token counts of the forward calls over an ``n``-token window: ``first``, then ``chunk`` each."""
    sizes = [min(first, n)]
    while sum(sizes) < n:
        sizes.append(min(chunk, n - sum(sizes)))
    return sizes


def chunked_logits(model, new_cache: Callable, sizes: Callable[[int], list[int]], window_bytes: list[CacheBytes]):
    """A ``LogitsFn`` feeding each window to ``model`` in calls of ``sizes(n)`` tokens, one fresh
    cache per window; appends each window's ``CacheBytes`` to ``window_bytes``."""

    def fn(ids: torch.Tensor) -> torch.Tensor:
        cache, logits, start = new_cache(), [], 0
        for n in sizes(ids.shape[1]):
            logits.append(model(input_ids=ids[:, start:start + n], cache=cache, use_cache=True).logits)
            start += n
        window_bytes.append(cache_bytes(cache))
        return torch.cat(logits, dim=1)

    return fn


def quantized_cache_factory(model, backend: str, bits: int, residual: int, group: int) -> Callable:
    from transformers import QuantizedCache

    axis_key, axis_value = KIVI_AXES[backend]
    return lambda: QuantizedCache(backend, model.config, nbits=bits, axis_key=axis_key, axis_value=axis_value,
                                  q_group_size=group, residual_length=residual)


def backend_missing(backend: str) -> str | None:
    try:
        importlib.import_module(BACKEND_MODULE[backend])
    except ImportError as e:
        return f"{BACKEND_MODULE[backend]} is not importable ({e})"
    return None
