"""One layer's 4- or 2-bit paged K/V (``low_bit_kv``), with the block being filled kept exact.

A block's keys are quantized per channel over its tokens, so they can only be quantized once the
block is full. Until then its rows live in a *residual* slot in the activation dtype (KIVI's
full-precision window, which paging gives for free: at most one open block per sequence). The
block whose last offset is written is quantized from its residual rows and its slot given back;
a block freed while open gives its slot back through ``release`` (the block manager's free hook).
Tokens of a sequence are written in position order, so offset 0 opens a block and offset
``block_size - 1`` closes it.
"""
from __future__ import annotations

import torch

from foundation.errors import KvslimError
from runtime.cache.low_bit_kv import (
    dequantize_keys,
    dequantize_values,
    quantize_key_blocks,
    quantize_value_rows,
)


class PackedLayerCache:
    """Views of one layer slot's packed tensors plus its residual slots."""

    def __init__(self, tensors: dict[str, torch.Tensor], bits: int, residual_dtype: torch.dtype):
        self.k_codes, self.v_codes = tensors["k_codes"], tensors["v_codes"]
        self.k_scale, self.k_min = tensors["k_scale"], tensors["k_min"]
        self.v_scale, self.v_min = tensors["v_scale"], tensors["v_min"]
        self.k_residual, self.v_residual = tensors["k_residual"], tensors["v_residual"]
        self.bits = bits
        self.block_size = self.k_codes.shape[1]
        num_blocks, num_slots = self.k_codes.shape[0], self.k_residual.shape[0]
        self.residual_dtype = residual_dtype
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=self.k_codes.device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def open_blocks(self) -> int:
        return int((self.slot_of >= 0).sum())

    def _open(self, block: int) -> None:
        """Give ``block`` a residual slot unless it holds one (a block reopened at offset 0 reuses its own)."""
        if int(self.slot_of[block]) < 0:
            if not self._free:
                raise KvslimError(f"all {self.k_residual.shape[0]} full-precision residual blocks are in use "
                                  "(more open blocks than running sequences)")
            self.slot_of[block] = self._free.pop()

    def release(self, block: int) -> None:
        """Give back ``block``'s residual slot, if it holds one (the block was freed while open)."""
        slot = int(self.slot_of[block])
        if slot >= 0:
            self.slot_of[block] = -1
            self._free.append(slot)

    def open_for(self, slots: torch.Tensor) -> torch.Tensor:
        """Give every block that ``slots`` write into a residual slot; return the blocks the write
        fills (their last offset is among ``slots``), to quantize and then ``close``. (The kernel
        path: every touched block holds a slot while the write runs.)"""
        bs = self.block_size
        for block in (slots // bs).unique().tolist():
            self._open(block)
        return (slots[slots % bs == bs - 1] // bs).unique()

    def close(self, full: torch.Tensor) -> None:
        """Give back the residual slots of ``full`` blocks, quantized now."""
        for block in full.tolist():
            self.release(block)

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new rows ``[T, kvh, D]`` at ``slots [T]``; quantize every block this write fills.

        Only blocks left open take a residual slot: a block this write fills is quantized from its
        residual rows (if it had some) and the new ones, so a prompt spanning many blocks needs no
        more slots than the one block it leaves open."""
        bs = self.block_size
        blocks, offsets = slots // bs, slots % bs
        closing = blocks[offsets == bs - 1].unique()  # sorted
        closes = torch.isin(blocks, closing)
        if closing.numel():  # first, so that the slots they give back serve the blocks opened now
            self._close(closing, blocks[closes], offsets[closes], k[closes], v[closes])
        stays = ~closes
        if bool(stays.any()):
            for block in blocks[stays].unique().tolist():
                self._open(block)
            index = self.slot_of[blocks[stays]]
            self.k_residual[index, offsets[stays]] = k[stays].to(self.residual_dtype)
            self.v_residual[index, offsets[stays]] = v[stays].to(self.residual_dtype)

    def _close(self, full: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Quantize blocks ``full`` (sorted) from their residual rows and new rows ``k, v`` at ``(blocks, offsets)``."""
        shape = (full.numel(), *self.k_residual.shape[1:])
        k_rows = torch.empty(shape, dtype=self.residual_dtype, device=k.device)
        v_rows = torch.empty(shape, dtype=self.residual_dtype, device=v.device)
        slot = self.slot_of[full]
        held = slot >= 0
        if bool(held.any()):
            k_rows[held], v_rows[held] = self.k_residual[slot[held]], self.v_residual[slot[held]]
        at = torch.searchsorted(full, blocks)
        k_rows[at, offsets] = k.to(self.residual_dtype)
        v_rows[at, offsets] = v.to(self.residual_dtype)
        self.k_codes[full], self.k_scale[full], self.k_min[full] = quantize_key_blocks(k_rows, self.bits)
        self.v_codes[full], self.v_scale[full], self.v_min[full] = quantize_value_rows(v_rows, self.bits)
        for b in full[held].tolist():
            self.release(b)

    def gather(self, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``blocks [..., nb]`` -> ``[..., nb * block_size, kvh, D]`` in ``dtype``: open blocks
        from their residual rows, the rest dequantized."""
        flat = blocks.reshape(-1)
        k = dequantize_keys(self.k_codes[flat], self.k_scale[flat], self.k_min[flat], self.bits, dtype)
        v = dequantize_values(self.v_codes[flat], self.v_scale[flat], self.v_min[flat], self.bits, dtype)
        slot = self.slot_of[flat]
        open_ = slot >= 0
        if bool(open_.any()):
            k[open_] = self.k_residual[slot[open_]].to(dtype)
            v[open_] = self.v_residual[slot[open_]].to(dtype)
        shape = (*blocks.shape[:-1], -1, *k.shape[2:])
        return k.reshape(shape), v.reshape(shape)
