"""One layer's 4- or 2-bit paged K/V (``low_bit_kv``), with the block being filled kept exact.

A block's keys are quantized per channel over its tokens, so they can only be quantized once the
block is full. Until then its rows live in a *residual* slot in the activation dtype (KIVI's
full-precision window, which paging gives for free: at most one open block per sequence). The
block whose last offset is written is quantized from its residual rows and the rows written now,
and its slot given back; a block filled within one write never takes a slot. A block freed
while open gives its slot back through ``release`` (the block manager's free hook). Tokens of a
sequence are written in position order, so offset 0 opens a block and offset ``block_size - 1``
closes it. Which block holds which slot is kept on the host too (``slot_host``), so opening,
closing and planning a write read nothing back from the device (on a GPU each such read was a sync
per open block and layer); the device copy ``slot_of`` is what the kernels read. A write's plan
(``WritePlan``) depends on its slots (and positions) alone: the step's batch computes it once per
cache group from its host copies (``PagedBatch.write_plan``), for every layer of the group.

With ``exact_first_block`` (``low_bit_kv.EXACT_FIRST_BLOCK_BITS``) a sequence's first block, which
holds its attention sinks, is quantized when it fills like any other but keeps its residual slot
while a sequence holds it, so every read of it is exact (KVQuant's and IntactKV's sink tokens kept
in full precision). Its codes serve a later prefix-cache hit on the freed block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from foundation.errors import KvslimError
from runtime.cache.low_bit_kv import (
    KEYS_BEFORE_ROPE_BITS,
    dequantize_keys,
    dequantize_values,
    quantize_key_blocks,
    quantize_value_rows,
)


@dataclass(frozen=True)
class WritePlan:
    """How one write moves: the blocks it fills, where their rows come from, the rows left open."""

    full: torch.Tensor  # [n] sorted blocks whose last offset the write holds
    src: torch.Tensor  # [n, block_size] int64: the write's row at each offset, -1 for the block's residual row
    stays: torch.Tensor  # [T] bool: rows kept in residual slots (of blocks left open, or kept exact)
    full_blocks: tuple[int, ...]  # ``full`` as ints (read once, not per layer)
    open_blocks: tuple[int, ...]  # the blocks of the rows that stay
    closed_blocks: tuple[int, ...]  # the filled blocks that give their residual slots back

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int, device: torch.device | str | None = None,
           positions: torch.Tensor | None = None) -> "WritePlan":
        """The plan of a write to ``slots [T]``, computed on the host (``slots`` there: no device
        read), its tensors on ``device`` (default: the slots'). ``positions [T]`` (host): the rows'
        sequence positions, given to keep each sequence's first block exact (rows at positions
        below ``block_size`` stay in their block's residual slot, filled or not)."""
        device = torch.device(device or slots.device)
        bs, host = block_size, slots.cpu()
        blocks, offsets = host // bs, host % bs
        full = blocks[offsets == bs - 1].unique()  # sorted
        fills = torch.isin(blocks, full)
        src = torch.full((full.numel(), bs), -1, dtype=torch.long, device="cpu")
        src[torch.searchsorted(full, blocks[fills]), offsets[fills]] = fills.nonzero().squeeze(1)
        kept = blocks[positions.cpu() < bs].unique() if positions is not None else blocks[:0]
        stays = ~fills | torch.isin(blocks, kept)

        def to_device(t: torch.Tensor) -> torch.Tensor:  # pinned: the copy queues behind the step's work
            return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

        return cls(to_device(full), to_device(src), to_device(stays), tuple(full.tolist()),
                   tuple(blocks[stays].unique().tolist()), tuple(full[~torch.isin(full, kept)].tolist()))


class PackedLayerCache:
    """Views of one layer slot's packed tensors plus its residual slots."""

    def __init__(self, tensors: dict[str, torch.Tensor], bits: int, residual_dtype: torch.dtype,
                 exact_first_block: bool = False):
        self.k_codes, self.v_codes = tensors["k_codes"], tensors["v_codes"]
        self.k_scale, self.k_min = tensors["k_scale"], tensors["k_min"]
        self.v_scale, self.v_min = tensors["v_scale"], tensors["v_min"]
        self.k_residual, self.v_residual = tensors["k_residual"], tensors["v_residual"]
        self.bits = bits
        self.keys_before_rope = bits in KEYS_BEFORE_ROPE_BITS  # the caller stores and reads keys unrotated
        self.exact_first_block = exact_first_block  # the caller's write plans keep first blocks in their slots
        self.block_size = self.k_codes.shape[1]
        num_blocks, num_slots = self.k_codes.shape[0], self.k_residual.shape[0]
        self.residual_dtype = residual_dtype
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=self.k_codes.device)
        self.slot_host = np.full(num_blocks, -1, dtype=np.int64)  # the same, read without a device sync
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def open_blocks(self) -> int:
        return int((self.slot_host >= 0).sum())

    def _set_slots(self, blocks: list[int], slots: list[int]) -> None:
        """Record ``blocks`` holding ``slots`` on the host and (one copy, no read back) on the device."""
        self.slot_host[blocks] = slots
        pairs = torch.tensor([blocks, slots], dtype=torch.long, device="cpu")
        if self.slot_of.is_cuda:  # pinned, so the copy queues behind the step's work instead of waiting for it
            pairs = pairs.pin_memory().to(self.slot_of.device, non_blocking=True)
        self.slot_of[pairs[0]] = pairs[1]

    def _open(self, blocks: tuple[int, ...]) -> None:
        """Give each of ``blocks`` a residual slot unless it holds one (a block reopened at offset 0
        reuses its own)."""
        new = [b for b in blocks if self.slot_host[b] < 0]
        if len(new) > len(self._free):
            raise KvslimError(f"all {self.k_residual.shape[0]} full-precision residual blocks are in use "
                              "(more open and exact first blocks than running sequences hold)")
        if new:
            self._set_slots(new, [self._free.pop() for _ in new])

    def release(self, block: int) -> None:
        """Give back ``block``'s residual slot, if it holds one (the block was freed while open)."""
        self._release((block,))

    def _release(self, blocks: tuple[int, ...]) -> None:
        held = [b for b in blocks if self.slot_host[b] >= 0]
        if held:
            self._free.extend(int(self.slot_host[b]) for b in held)
            self._set_slots(held, [-1] * len(held))

    def apply_write(self, slots: torch.Tensor, quantize: Callable[[WritePlan], None],
                    store: Callable[[torch.Tensor], None], plan: WritePlan | None = None) -> None:
        """The order of every write, whichever code moves the data: ``quantize(plan)`` the blocks it
        fills, give back the slots they held (but a first block kept exact), give the blocks left
        open slots, then ``store(stays)`` their rows at ``slot_of``. Filled blocks go first, so the
        slots they free serve the blocks opened now, and a prompt spanning many blocks needs no more
        slots than the blocks it leaves open (and keeps exact).
        ``plan``: the step's, computed once for the slots (default: computed here, no block kept exact)."""
        plan = plan or WritePlan.of(slots, self.block_size)
        if plan.full_blocks:
            quantize(plan)
            self._release(plan.closed_blocks)
        if plan.open_blocks:
            self._open(plan.open_blocks)
            store(plan.stays)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, plan: WritePlan | None = None) -> None:
        """Store new rows ``[T, kvh, D]`` at ``slots [T]``; quantize every block this write fills."""
        bs = self.block_size

        def quantize(plan: WritePlan) -> None:
            full = plan.full
            self.k_codes[full], self.k_scale[full], self.k_min[full] = quantize_key_blocks(
                self._filled_rows(plan, k, self.k_residual), self.bits)
            self.v_codes[full], self.v_scale[full], self.v_min[full] = quantize_value_rows(
                self._filled_rows(plan, v, self.v_residual), self.bits)

        def store(stays: torch.Tensor) -> None:
            index, offsets = self.slot_of[slots[stays] // bs], slots[stays] % bs
            self.k_residual[index, offsets] = k[stays].to(self.residual_dtype)
            self.v_residual[index, offsets] = v[stays].to(self.residual_dtype)

        self.apply_write(slots, quantize, store, plan)

    def _filled_rows(self, plan: WritePlan, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Rows ``[n_full, block_size, kvh, D]`` of the filled blocks in the residual dtype: this
        write's rows ``x`` where ``plan.src >= 0``, else the block's residual row (0 if it holds none)."""
        rows = torch.zeros((plan.full.numel(), *residual.shape[1:]), dtype=residual.dtype, device=residual.device)
        if (self.slot_host[list(plan.full_blocks)] >= 0).any():  # some filled block had rows in a residual slot
            slot = self.slot_of[plan.full]
            held = slot >= 0
            rows[held] = residual[slot[held]]
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
        k = dequantize_keys(self.k_codes[flat], self.k_scale[flat], self.k_min[flat], self.bits, key_dtype)
        v = dequantize_values(self.v_codes[flat], self.v_scale[flat], self.v_min[flat], self.bits, dtype)
        if (self.slot_host >= 0).any():  # some block is open (the host's record: no device read)
            slot = self.slot_of[flat]
            open_ = slot >= 0
            k[open_] = self.k_residual[slot[open_]].to(key_dtype)
            v[open_] = self.v_residual[slot[open_]].to(dtype)
        shape = (*blocks.shape[:-1], -1, *k.shape[2:])
        return k.reshape(shape), v.reshape(shape)
