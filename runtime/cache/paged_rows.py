"""Rows in and out of one paged K or V tensor: the one store and the one gather.

A cache tensor is ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot ``s`` is block
``s // block_size``, offset ``s % block_size``. Its scale (quantized caches only) is per token and
head ``[num_blocks, block_size, num_kv_heads]`` (computed on write) or one static value. The
engine's cache (``KVCache``) and the kernels' plain-torch references both store and gather here.
"""
from __future__ import annotations

import torch

from runtime.cache.kv_quant import dequantize, quantize_per_token_head, quantize_static


def _per_token(cache: torch.Tensor, scale: torch.Tensor) -> bool:
    return tuple(scale.shape) == tuple(cache.shape[:3])


def store_rows(cache: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``x [T, kvh, D]`` at ``slots [T]`` (int64, all valid), quantizing on write."""
    if scale is None:
        q = x.to(cache.dtype)
    elif not _per_token(cache, scale):
        q = quantize_static(x, scale.reshape(()), cache.dtype)
    else:
        q, s = quantize_per_token_head(x, cache.dtype)
        scale.view(-1, scale.shape[-1]).index_copy_(0, slots, s)
    if q.dtype == torch.float8_e4m3fn:  # CPU index_copy_ has no fp8 kernel: copy the bytes
        cache, q = cache.view(torch.uint8), q.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, q)


def gather_blocks(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of ``blocks [..., nb]`` (physical ids) -> ``[..., nb * block_size, kvh, D]`` in
    ``dtype``, dequantized."""
    flat_ids = blocks.reshape(-1)
    x = cache.index_select(0, flat_ids).view(*blocks.shape, *cache.shape[1:])  # [..., nb, bs, kvh, D]
    if scale is not None:
        if _per_token(cache, scale):
            scale = scale.index_select(0, flat_ids).view(*blocks.shape, *scale.shape[1:])
        else:
            scale = scale.reshape(())
        x = dequantize(x, scale, dtype)
    elif x.dtype != dtype:
        x = x.to(dtype)
    return x.flatten(-4, -3)
