"""How one step's write moves through a packed int4/int2 cache group (``packed_layer``).

A write's plan depends on its slots (and positions) alone, so the step's batch computes it once per
cache group on the host (``PagedBatch.write_plan``) and the group's slot table fills in the slots its
filled blocks held (``ResidualSlots.apply``), for every layer of the group. A CUDA graph replays
fixed launch shapes, so its decode step takes the plan per row (``WritePlan.per_row_plan``): one entry
for each of the bucket's rows, in persistent buffers the step refills (``runtime.engine.cuda_graphs``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from runtime.transfer import to_device_at_once


@dataclass(frozen=True)
class WritePlan:
    """How one write moves: the blocks it fills, where their rows come from, the rows left open."""

    full: torch.Tensor  # [n] sorted blocks whose last offset the write holds
    src: torch.Tensor  # [n, block_size] int64: the write's row at each offset, -1 for the block's residual row
    stays: torch.Tensor  # [T] bool: rows kept in residual slots (of blocks left open, or kept exact)
    full_blocks: tuple[int, ...]  # ``full`` as ints (read once, not per layer)
    open_blocks: tuple[int, ...]  # the blocks of the rows that stay
    closed_blocks: tuple[int, ...]  # the filled blocks that give their residual slots back
    # [n] bool: filled blocks that are their sequence's first (its attention sinks), whose key
    # ranges are not clipped (none where no positions were given)
    first: torch.Tensor
    full_slots: torch.Tensor | None = None  # [n] the residual slot each filled block held (-1: none), set by ResidualSlots.apply
    refills: bool = False  # some filled block held residual rows (so they are read)
    per_row: bool = False  # one entry per write row (``full[i]`` -1 where row i fills no block): fixed shapes

    def per_row_plan(self, rows: int) -> "WritePlan":
        """This plan, its slots applied and on the host, with one entry per write row padded to
        ``rows``: ``full[i]`` the block whose last offset row i writes (-1: none), with that block's
        ``src`` and ``full_slots``; ``stays`` False past the write. The kernels launch over every
        entry and skip the -1s, so a CUDA graph's launch shapes do not depend on the step."""
        if self.full_slots is None:
            raise ValueError("a per-row plan is made from an applied plan (ResidualSlots.apply)")
        last = self.src[:, -1]  # the row writing each filled block's last offset
        full = torch.full((rows,), -1, dtype=torch.long)
        src = torch.full((rows, self.src.shape[1]), -1, dtype=torch.long)
        full_slots = torch.full((rows,), -1, dtype=torch.long)
        full[last], src[last], full_slots[last] = self.full, self.src, self.full_slots
        stays = torch.zeros(rows, dtype=torch.bool)
        stays[:self.stays.numel()] = self.stays
        first = torch.zeros(rows, dtype=torch.bool)
        first[last] = self.first
        return replace(self, full=full, src=src, stays=stays, full_slots=full_slots, refills=True, per_row=True,
                       first=first)

    def compact(self) -> "WritePlan":
        """A per-row plan as the filled blocks alone (reads ``full`` on the host: the torch path's)."""
        if not self.per_row:
            return self
        keep = self.full >= 0
        full = self.full[keep]
        return replace(self, full=full, src=self.src[keep], full_slots=self.full_slots[keep],
                       full_blocks=tuple(full.tolist()), per_row=False,
                       first=self.first[keep])

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int, device: torch.device | str | None = None,
           positions: torch.Tensor | None = None, keep_first_exact: bool = False) -> "WritePlan":
        """The plan of a write to ``slots [T]``, computed on the host (``slots`` there: no device
        read), its tensors on ``device`` (default: the slots'). ``positions [T]`` (host): the rows'
        sequence positions, which mark each sequence's first block (``first``); with
        ``keep_first_exact`` its rows stay in their block's residual slot, filled or not."""
        device = torch.device(device or slots.device)
        bs, host = block_size, slots.cpu()
        blocks, offsets = host // bs, host % bs
        full = blocks[offsets == bs - 1].unique()  # sorted
        fills = torch.isin(blocks, full)
        src = torch.full((full.numel(), bs), -1, dtype=torch.long, device="cpu")
        src[torch.searchsorted(full, blocks[fills]), offsets[fills]] = fills.nonzero().squeeze(1)
        firsts = blocks[positions.cpu() < bs].unique() if positions is not None else blocks[:0]
        kept = firsts if keep_first_exact else blocks[:0]
        stays = ~fills | torch.isin(blocks, kept)
        full_t, src_t, stays_t, first = to_device_at_once((full, src, stays, torch.isin(full, firsts)), device)
        return cls(full_t, src_t, stays_t, tuple(full.tolist()), tuple(blocks[stays].unique().tolist()),
                   tuple(full[~torch.isin(full, kept)].tolist()), first)
