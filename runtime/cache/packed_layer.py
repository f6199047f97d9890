"""One layer's packed low-bit paged K/V (``low_bit_kv``), with the block being filled kept exact.

A block's keys are quantized per channel over its tokens, so they can only be quantized once the
block is full. Until then its rows live in a *residual* slot in the activation dtype (KIVI's
full-precision window, which paging gives for free: at most one open block per sequence). The
block whose last offset is written is quantized from its residual rows and the rows written now,
and its slot given back; a block filled within one write never takes a slot. A block freed
while open gives its slot back (the block manager's free hook). Tokens of a sequence are written
in position order, so offset 0 opens a block and offset ``block_size - 1`` closes it.

Which block holds which slot is the cache group's (``ResidualSlots``: one table for all its layers,
on the device for the kernels and mirrored on the host, updated once per step); a layer holds its
own residual rows at those slots. A step's write is planned once per group (``WritePlan``: which
blocks fill, where their rows come from, which rows stay, and the slots the filled blocks held),
then every layer of the group moves its data by that plan: no bookkeeping per layer.

With ``exact_first_block`` (``CacheGroup.exact_first_block``) a sequence's first block, which
holds its attention sinks, is quantized when it fills like any other but keeps its residual slot
while a sequence holds it, so every read of it is exact (KVQuant's and IntactKV's sink tokens kept
in full precision). Its codes serve a later prefix-cache hit on the freed block.
"""
from __future__ import annotations

from typing import Callable

import torch

from foundation.errors import KvslimError
from runtime.cache.compiled_kv_read import read_packed_keys, read_packed_values
from runtime.cache.kv_rotation import KvRotation
from runtime.cache.low_bit_kv import quantize_key_blocks, quantize_value_rows
from runtime.cache.packed_recipe import PackedRecipe
from runtime.cache.residual_slots import ResidualSlots
from runtime.cache.write_plan import WritePlan


class PackedLayerCache:
    """Views of one layer slot's packed tensors and residual rows, over its group's slot table."""

    def __init__(self, tensors: dict[str, torch.Tensor], recipe: PackedRecipe, residual_dtype: torch.dtype,
                 exact_first_block: bool, slots: ResidualSlots, value_rotation: KvRotation | None = None,
                 key_rotation: KvRotation | None = None):
        """``recipe``: the group's storage rules; ``slots``: the cache group's slot table, shared by
        its layers; ``value_rotation``: the group's value basis (None: values as they are), which the
        caller rotates values into and attention outputs out of; ``key_rotation``: its key basis, which
        the caller rotates keys (after RoPE) and queries into."""
        self.k_codes, self.v_codes = tensors["k_codes"], tensors["v_codes"]
        self.k_scale, self.k_min = tensors["k_scale"], tensors["k_min"]
        self.v_scale, self.v_min = tensors["v_scale"], tensors["v_min"]
        self.k_residual, self.v_residual = tensors["k_residual"], tensors["v_residual"]
        self.bits = recipe.bits
        self.keys_before_rope = recipe.keys_before_rope  # the caller stores and reads keys unrotated
        self.keys_clipped = recipe.keys_clipped
        self.value_rotation = value_rotation
        self.key_rotation = key_rotation
        if key_rotation is not None and self.keys_before_rope:
            raise KvslimError("keys stored before RoPE cannot also be kept in a rotated basis")
        self.exact_first_block = exact_first_block  # the caller's write plans keep first blocks in their slots
        self.block_size = self.k_codes.shape[1]
        self.residual_dtype = residual_dtype
        self.slots = slots
        if self.slots.num_slots != self.k_residual.shape[0]:
            raise KvslimError(f"a slot table of {self.slots.num_slots} slots over {self.k_residual.shape[0]} residual blocks")

    @property
    def slot_of(self) -> torch.Tensor:
        """``[num_blocks]`` int64 on the device: each block's residual slot, -1 where it has none."""
        return self.slots.slot_of

    @property
    def slot_host(self):
        return self.slots.slot_host

    @property
    def open_blocks(self) -> int:
        return self.slots.open_blocks

    def release(self, block: int) -> None:
        """Give back ``block``'s residual slot, if it holds one (the block was freed while open)."""
        self.slots.release((block,))

    def apply_write(self, slots: torch.Tensor, quantize: Callable[[WritePlan], None],
                    store: Callable[[torch.Tensor], None], plan: WritePlan | None = None) -> None:
        """The order of every write, whichever code moves the data: ``quantize(plan)`` the blocks it
        fills (from ``plan.full_slots``), then ``store(stays)`` the rows that stay at ``slot_of``.
        ``plan``: the step's, its slots already applied to the group's table (``ResidualSlots.apply``);
        default: planned and applied here, for a write to a group of this one layer."""
        if plan is None:
            plan = self.slots.apply(WritePlan.of(slots, self.block_size))
        elif plan.full_slots is None:
            raise KvslimError("a packed write's plan must have its slots applied (ResidualSlots.apply) first")
        if plan.per_row:  # fixed launch shapes (a CUDA graph): every entry, the kernels skip the unused
            quantize(plan)
            store(plan.stays)
            return
        if plan.full_blocks:
            quantize(plan)
        if plan.open_blocks:
            store(plan.stays)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, plan: WritePlan | None = None) -> None:
        """Store new rows ``[T, kvh, D]`` at ``slots [T]``; quantize every block this write fills."""
        bs = self.block_size
        plan = plan.compact() if plan is not None else None

        def quantize(plan: WritePlan) -> None:
            full = plan.full
            self.k_codes[full], self.k_scale[full], self.k_min[full] = quantize_key_blocks(
                self._filled_rows(plan, k, self.k_residual), self.bits.keys, plan.first, self.keys_clipped)
            self.v_codes[full], self.v_scale[full], self.v_min[full] = quantize_value_rows(
                self._filled_rows(plan, v, self.v_residual), self.bits.values)

        def store(stays: torch.Tensor) -> None:
            index, offsets = self.slot_of[slots[stays] // bs], slots[stays] % bs
            self.k_residual[index, offsets] = k[stays].to(self.residual_dtype)
            self.v_residual[index, offsets] = v[stays].to(self.residual_dtype)

        self.apply_write(slots, quantize, store, plan)

    def _filled_rows(self, plan: WritePlan, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Rows ``[n_full, block_size, kvh, D]`` of the filled blocks in the residual dtype: this
        write's rows ``x`` where ``plan.src >= 0``, else the block's residual row (0 if it held none)."""
        rows = torch.zeros((plan.full.numel(), *residual.shape[1:]), dtype=residual.dtype, device=residual.device)
        if plan.refills:
            held = plan.full_slots >= 0
            rows[held] = residual[plan.full_slots[held]]
        new = plan.src >= 0
        rows[new] = x[plan.src[new]].to(residual.dtype)
        return rows

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype,
               key_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``blocks [..., nb]`` -> ``[..., nb * block_size, kvh, D]`` in ``dtype`` (keys in
        ``key_dtype`` if given: fp32 for keys still to be rotated): open blocks from their residual
        rows, the rest dequantized."""
        flat = blocks.reshape(-1)
        key_dtype = key_dtype or dtype
        k = read_packed_keys(self.k_codes, self.k_scale, self.k_min, flat, self.bits.keys, key_dtype)
        v = read_packed_values(self.v_codes, self.v_scale, self.v_min, flat, self.bits.values, dtype)
        if (self.slot_host >= 0).any():  # some block is open (the host's record: no device read)
            slot = self.slot_of[flat]
            open_ = slot >= 0
            k[open_] = self.k_residual[slot[open_]].to(key_dtype)
            v[open_] = self.v_residual[slot[open_]].to(dtype)
        shape = (*blocks.shape[:-1], -1, *k.shape[2:])
        return k.reshape(shape), v.reshape(shape)
