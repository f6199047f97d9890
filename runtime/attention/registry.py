"""Attention backends by name.

    backend = make_attention_backend("torch", cache, params)

- ``torch``: ``runtime.attention.paged.PagedAttentionBackend``, SDPA over the paged blocks (the
  CPU path);
- ``triton``: ``runtime.attention.triton_backend.KernelAttentionBackend``, one store and one paged
  attention kernel per layer (Triton on CUDA, the kernels' torch references elsewhere).

A new backend (a GPU library, a quantized-KV layout) registers here; the engine only names it.
"""
from __future__ import annotations

from collections.abc import Sequence

from foundation.errors import KvslimError
from runtime.attention.backend import AttentionParams
from runtime.attention.paged import PagedAttentionBackend
from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.cache.kv_cache import KVCache

# name -> class; the class takes (cache, per-layer params) and has set_batch / attend.
ATTENTION_BACKENDS: dict[str, type] = {
    "torch": PagedAttentionBackend,
    "triton": KernelAttentionBackend,
}
DEFAULT_ATTENTION_BACKEND = "torch"


def make_attention_backend(name: str, cache: KVCache, params: Sequence[AttentionParams], **options):
    """The backend registered as ``name`` over ``cache`` (``options``: its own, e.g. the Triton
    backend's ``use_triton``); one line naming the choices otherwise."""
    if name not in ATTENTION_BACKENDS:
        raise KvslimError(f"attention backend {name!r} is not known (known: {', '.join(ATTENTION_BACKENDS)})")
    return ATTENTION_BACKENDS[name](cache, params, **options)


def default_attention_backend(kernels: str) -> str:
    """The backend for a model's kernel family (``runtime.device.Placement.kernels``)."""
    return "triton" if kernels == "triton" else DEFAULT_ATTENTION_BACKEND
