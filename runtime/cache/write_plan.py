"""How one step's write moves through a packed int4/int2 cache group (``packed_layer``).

A write's plan depends on its slots (and positions) alone, so the step's batch computes it once per
cache group on the host (``PagedBatch.write_plan``) and the group's slot table fills in the slots its
filled blocks held (``ResidualSlots.apply``), for every layer of the group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA from pinned memory, so the copy queues behind the
    step's work instead of waiting for it."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass(frozen=True)
class WritePlan:
    """How one write moves: the blocks it fills, where their rows come from, the rows left open."""

    full: torch.Tensor  # [n] sorted blocks whose last offset the write holds
    src: torch.Tensor  # [n, block_size] int64: the write's row at each offset, -1 for the block's residual row
    stays: torch.Tensor  # [T] bool: rows kept in residual slots (of blocks left open, or kept exact)
    full_blocks: tuple[int, ...]  # ``full`` as ints (read once, not per layer)
    open_blocks: tuple[int, ...]  # the blocks of the rows that stay
    closed_blocks: tuple[int, ...]  # the filled blocks that give their residual slots back
    full_slots: torch.Tensor | None = None  # [n] the residual slot each filled block held (-1: none), set by ResidualSlots.apply
    refills: bool = False  # some filled block held residual rows (so they are read)

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
        return cls(to_device(full, device), to_device(src, device), to_device(stays, device), tuple(full.tolist()),
                   tuple(blocks[stays].unique().tolist()), tuple(full[~torch.isin(full, kept)].tolist()))
