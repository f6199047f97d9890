"""Which block of one int4/int2 cache group holds which full-precision residual slot.

Every layer of a cache group opens and closes the same blocks in the same step (they share block
tables), so the group keeps one table: ``slot_of`` on the device (what the kernels read) and its
host mirror ``slot_host`` (what planning reads, without a device sync), updated once per step by
``apply`` before the group's layers write, however many layers it holds. Each layer keeps its own
residual rows at those slots (``PackedLayerCache``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from foundation.errors import KvslimError
from runtime.cache.write_plan import WritePlan
from runtime.transfer import to_device


class ResidualSlots:
    def __init__(self, num_blocks: int, num_slots: int, device: torch.device | str):
        self.num_slots = num_slots
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self.slot_host = np.full(num_blocks, -1, dtype=np.int64)  # the same, read without a device sync
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def open_blocks(self) -> int:
        return int((self.slot_host >= 0).sum())

    def _set(self, blocks: list[int], slots: list[int]) -> None:
        """Record ``blocks`` holding ``slots`` on the host and (one copy, no read back) on the device."""
        self.slot_host[blocks] = slots
        pairs = to_device(torch.tensor([blocks, slots], dtype=torch.long, device="cpu"), self.slot_of.device)
        self.slot_of[pairs[0]] = pairs[1]

    def apply(self, plan: WritePlan) -> WritePlan:
        """One step's bookkeeping for ``plan``: the slots its filled blocks hold (they quantize from
        them: ``full_slots``), given back unless the block is kept exact, then slots for the blocks
        it leaves open. Filled blocks go first, so the slots they free serve the blocks opened now.
        Returns the plan with ``full_slots`` on the plan's device, for every layer of the group."""
        held = self.slot_host[list(plan.full_blocks)]  # a copy (fancy indexing)
        full_slots = to_device(torch.from_numpy(held), plan.full.device)
        self.release(plan.closed_blocks)
        new = [b for b in plan.open_blocks if self.slot_host[b] < 0]  # a block reopened keeps its own
        if len(new) > len(self._free):
            raise KvslimError(f"all {self.num_slots} full-precision residual blocks are in use "
                              "(more open and exact first blocks than running sequences hold)")
        if new:
            self._set(new, [self._free.pop() for _ in new])
        return replace(plan, full_slots=full_slots, refills=bool((held >= 0).any()))

    def release(self, blocks: tuple[int, ...]) -> None:
        """Give back the slots ``blocks`` hold (a block freed while open, or one just quantized)."""
        held = [b for b in blocks if self.slot_host[b] >= 0]
        if held:
            self._free.extend(int(self.slot_host[b]) for b in held)
            self._set(held, [-1] * len(held))
