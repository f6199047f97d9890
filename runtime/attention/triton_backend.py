"""An ``AttentionBackend`` over the engine's paged ``KVCache`` that runs the kernels.

Same interface as ``runtime.attention.paged.PagedAttentionBackend`` (``set_batch`` then ``attend``
per layer), but each layer is one store (quantize on write) and one paged attention call over the
whole flattened batch: Triton on CUDA, the plain-torch references on CPU.
bf16/fp16/fp32/fp8/int8 layers take ``store_kv`` and ``paged_attention``; packed int4/int2 layers
(``PackedLayerCache``) ``store_packed_kv`` and ``packed_paged_attention``. Over a quantized cache
(FP8/INT8 or packed) the attention reads the step's own new rows exact from ``k``/``v``, as the
torch path (``Engine.score``: each token only its own row, as a decode step reads it). Layers that
read another layer's KV get the owner's cache tensors, and over a quantized cache the owner's new
rows of this step. Keys arrive before rotary and are rotated here (torch) before the store, except
in a layout that stores them before RoPE (int2, k3v2), whose attention kernel rotates each key it
reads. Values of a layer with 2-bit values (int2, k4v2, k3v2) are rotated into its cache's basis
before the store and the output back; with 4-bit keys (int4, k4v2) the keys after RoPE and the
queries are rotated into it (``kv_rotation``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.errors import KvslimError
from runtime.attention.backend import AttentionParams
from runtime.attention.key_rope import StepKeyRotary
from runtime.attention.paged import PagedBatch
from runtime.cache.kv_cache import KVCache
from runtime.cache.packed_layer import PackedLayerCache
from runtime.cache.write_plan import WritePlan


def _kernels(use_triton: bool) -> tuple:
    """(store, attention, packed store, packed attention): the Triton kernels or their plain-torch
    references, one signature each. Imported here: ``triton`` is an optional extra."""
    from runtime.kernels import kv_store as kvs
    from runtime.kernels import packed_kv_store as pks
    from runtime.kernels import packed_paged_attention as ppa
    from runtime.kernels import paged_attention as pa

    if use_triton:
        return kvs.store_kv, pa.paged_attention, pks.store_packed_kv, ppa.packed_paged_attention
    return (kvs.reference_store_kv, pa.reference_paged_attention, pks.reference_store_packed_kv,
            ppa.reference_packed_paged_attention)


class KernelAttentionBackend:
    """Paged attention through ``runtime.kernels``, chosen once here: the Triton kernels on a CUDA
    cache, their torch references elsewhere. ``use_triton`` overrides that choice (True on a CPU
    runs the Triton kernels under ``TRITON_INTERPRET=1``, for tests; False the references on CUDA).
    """

    def __init__(self, cache: KVCache, params: Sequence[AttentionParams], use_triton: bool | None = None):
        self.cache = cache
        self.params = tuple(params)
        self.batch: PagedBatch | None = None
        if use_triton is None:
            use_triton = cache.device.type == "cuda"
        self._store, self._attention, self._store_packed, self._attention_packed = _kernels(use_triton)
        self._rotate_keys = None  # the step's new keys: apply_rotary, or its kernel
        if use_triton:
            from runtime.kernels.rotary import rotary

            self._rotate_keys = rotary
        self._write_plans: dict[int, WritePlan] = {}  # the step's packed writes, by cache group
        self._launch_bounds: dict = {}
        # int4/int2: each cache slot's new rows this step, for the layers that read that slot's KV
        self._new_rows_by_slot: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rotary: StepKeyRotary | None = None
        self._check_layers()
        from runtime.kernels.paged_attention import check_batch  # with the kernels: triton is optional
        self._check_metadata = check_batch

    def _check_layers(self) -> None:
        """Every layer's cache as the kernels index it, once: the calls then skip the checks."""
        from runtime.kernels.kv_store import check_layer_cache
        from runtime.kernels.packed_kv_store import check_packed_layer
        from runtime.kernels.packed_paged_attention import check_packed_rope

        for layer_idx, lc in enumerate(self.cache.layers):
            if isinstance(lc, PackedLayerCache):
                check_packed_layer(lc)
                rope = self.params[self.params[layer_idx].kv_source].key_rope
                check_packed_rope(lc, rope if lc.keys_before_rope else None)
            else:
                check_layer_cache(lc.k_cache, lc.v_cache, lc.k_scale, lc.v_scale)

    def _check_batch(self, batch: PagedBatch) -> None:
        """The step's metadata, once per step (not once per layer)."""
        device, tokens = self.cache.device, batch.positions.shape[0]
        for g, table in enumerate(batch.block_tables):
            self._check_metadata(table, batch.context_lens, batch.query_start_loc, device)
            slots = batch.slot_mapping[g]
            if slots.dtype != torch.int64 or tuple(slots.shape) != (tokens,) or slots.device != device:
                raise KvslimError(f"slot_mapping must be int64 [{tokens}] on {device}, "
                                  f"got {slots.dtype} {tuple(slots.shape)} on {slots.device}")

    def set_batch(self, batch: PagedBatch, max_context_len: int | None = None) -> None:
        """``max_context_len``: launch the attention for this context whatever the batch holds (a
        CUDA graph's fixed launch shape; each program still reads only its sequence's keys)."""
        self._check_batch(batch)
        self.batch = batch
        self._write_plans = batch.packed_writes(self.cache)  # int4/int2 groups: once per step
        self._new_rows_by_slot = {}
        self._rotary = StepKeyRotary(batch.positions, self._rotate_keys)
        self._launch_bounds = dict(
            max_query_len=max(batch.query_lens, default=0),
            max_context_len=max_context_len if max_context_len is not None else
            max((f + n for f, n in zip(batch.first_positions, batch.query_lens)), default=0),
        )

    def share_rotary(self, tables: dict) -> None:
        """The decoder's cos/sin of this step by (rope, dtype): the keys rotate by them too."""
        self._rotary.share(tables)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        batch = self.batch
        assert batch is not None, "set_batch() before attend()"
        slot = self.cache.spec.layer_slots[layer_idx]
        g = slot[0]
        lc = self.cache.layers[layer_idx]
        params = self.params[layer_idx]
        rope = self.params[params.kv_source].key_rope  # the keys' rotation is their owner's
        k_rotated = None if k is None else self._rotary(rope, k)
        meta = (batch.block_tables[g], batch.context_lens, batch.query_start_loc, params.scale, params.window, params.softcap)
        if isinstance(lc, PackedLayerCache):
            read_rope = rope if lc.keys_before_rope else None  # the kernel rotates each key it reads
            rotation = lc.value_rotation  # values in the cache's basis, the output back out of it
            if v is not None and rotation is not None:
                v = rotation.rotate(v)
            if lc.key_rotation is not None:  # keys after RoPE and queries in the cache's basis
                q = lc.key_rotation.rotate(q)
                k_rotated = None if k_rotated is None else lc.key_rotation.rotate(k_rotated)
            if k is not None:
                self._store_packed(k if read_rope else k_rotated, v, lc, batch.slot_mapping[g],
                                   plan=self._write_plans[g], validate=False)
                self._new_rows_by_slot[slot] = (k_rotated, v)
            # a layer reading another layer's KV reads its new rows exact too
            k, v = self._new_rows_by_slot.get(slot, (None, None))
            out = self._attention_packed(q, k, v, lc, *meta, sinks=params.sinks, key_rope=read_rope,
                                         validate=False, **self._launch_bounds)
            return out if rotation is None else rotation.restore(out)
        if k is not None:
            self._store(k_rotated, v, lc.k_cache, lc.v_cache, batch.slot_mapping[g], lc.k_scale, lc.v_scale,
                        validate=False)
            self._new_rows_by_slot[slot] = (k_rotated, v)
        # a quantized cache: the step's new rows read exact, or each token only its own (a layer
        # reading another's KV too)
        quantized = lc.k_scale is not None
        k, v = self._new_rows_by_slot.get(slot, (None, None)) if quantized else (None, None)
        return self._attention(q, lc.k_cache, lc.v_cache, *meta, lc.k_scale, lc.v_scale, sinks=params.sinks,
                               k=k, v=v, own_row_only=not batch.exact_new_rows, validate=False,
                               **self._launch_bounds)
