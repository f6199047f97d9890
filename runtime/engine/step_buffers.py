"""Persistent step inputs in one arena: every buffer a view of one host tensor (pinned on CUDA) and
of its device twin at the same offset, so that a step's inputs, written on the host, reach the
device in one non-blocking copy (vLLM's CPU-GPU buffers, fused into one transfer)."""
from __future__ import annotations

import torch

from runtime.transfer import ALIGN


class StepBuffers:
    """Buffers allocated once, then ``copy_to_device`` after each step's host writes."""

    def __init__(self, device: torch.device):
        self.target = device
        self._specs: list[tuple[int, tuple[int, ...], torch.dtype, int | bool]] = []
        self._size = 0
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None

    def add(self, size: tuple[int, ...], dtype: torch.dtype, fill: int | bool) -> int:
        """Reserve a buffer of ``size`` ``dtype`` elements, every one ``fill``; returns its handle.
        All buffers are reserved before the first ``host`` or ``device`` view."""
        if self._host is not None:
            raise RuntimeError("StepBuffers: every buffer is reserved before the arena is made")
        nbytes = torch.Size(size).numel() * dtype.itemsize
        self._specs.append((self._size, tuple(size), dtype, fill))
        self._size += -(-nbytes // ALIGN) * ALIGN
        return len(self._specs) - 1

    def _arena(self) -> None:
        if self._host is None:
            self._host = torch.zeros(max(self._size, ALIGN), dtype=torch.uint8, device="cpu",
                                     pin_memory=self.target.type == "cuda")
            for h in range(len(self._specs)):
                self.host(h).fill_(self._specs[h][3])
            self._dev = self._host.to(self.target)

    def _view(self, arena: torch.Tensor, handle: int) -> torch.Tensor:
        offset, size, dtype, _ = self._specs[handle]
        nbytes = torch.Size(size).numel() * dtype.itemsize
        return arena[offset:offset + nbytes].view(dtype).view(size)

    def host(self, handle: int) -> torch.Tensor:
        """The buffer's host side (written by the step)."""
        self._arena()
        return self._view(self._host, handle)

    def device(self, handle: int) -> torch.Tensor:
        """The buffer's device side (read by the forward; a graph captures its address)."""
        self._arena()
        return self._view(self._dev, handle)

    def copy_to_device(self) -> None:
        """Every buffer's host side to the device: one non-blocking copy."""
        self._arena()
        self._dev.copy_(self._host, non_blocking=True)

    @property
    def nbytes(self) -> int:
        return self._size
