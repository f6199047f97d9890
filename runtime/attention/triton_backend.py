"""An ``AttentionBackend`` over the engine's paged ``KVCache`` that runs the kernels.

Same interface as ``runtime.attention.paged.PagedAttentionBackend`` (``set_batch`` then ``attend``
per layer), but each layer is one ``store_kv`` (quantize on write) and one ``paged_attention``
call over the whole flattened batch, routed by ``dispatch``: Triton on CUDA, the plain-torch
references on CPU. Layers that read another layer's KV get the owner's tensors from the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.errors import KvslimError
from runtime.attention.backend import AttentionParams
from runtime.attention.paged import PagedBatch
from runtime.cache.kv_cache import KVCache
from runtime.kernels import dispatch
from runtime.kernels import kv_store as kvs
from runtime.kernels import paged_attention as pa


class KernelAttentionBackend:
    """Paged attention through ``runtime.kernels``.

    ``use_triton``: None routes by device (``dispatch``); True forces the Triton kernels (on CPU
    only under ``TRITON_INTERPRET=1``, for tests); False forces the torch references.
    """

    def __init__(self, cache: KVCache, params: Sequence[AttentionParams], use_triton: bool | None = None):
        low_bit = sorted({g.kv_dtype for g in cache.spec.groups if g.bits})
        if low_bit:
            raise KvslimError(f"the kernel attention backend has no {'/'.join(low_bit)} KV layout yet; "
                              "use the torch backend")
        self.cache = cache
        self.params = tuple(params)
        self.batch: PagedBatch | None = None
        self._store = {None: dispatch.store_kv, True: kvs.store_kv, False: kvs.reference_store_kv}[use_triton]
        self._use_triton = use_triton
        self._maxima: dict = {}

    def set_batch(self, batch: PagedBatch) -> None:
        self.batch = batch
        self._maxima = dict(
            max_query_len=max(batch.query_lens, default=0),
            max_context_len=max((f + n for f, n in zip(batch.first_positions, batch.query_lens)), default=0),
        )

    def _attend(self, *args) -> torch.Tensor:
        if self._use_triton is None:
            return dispatch.paged_attention(*args, **self._maxima)
        if self._use_triton:
            return pa.paged_attention(*args, **self._maxima)
        return pa.reference_paged_attention(*args)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "set_batch() before attend()"
        g, _ = self.cache.spec.layer_slots[layer_idx]
        lc = self.cache.layers[layer_idx]
        params = self.params[layer_idx]
        if k is not None:
            self._store(k, v, lc.k_cache, lc.v_cache, batch.slot_mapping[g], lc.k_scale, lc.v_scale)
        return self._attend(
            q, lc.k_cache, lc.v_cache, batch.block_tables[g], batch.context_lens, batch.query_start_loc,
            params.scale, params.window, params.softcap, lc.k_scale, lc.v_scale,
        )
