"""Host tensors to the device: from pinned memory and non-blocking on CUDA, so a copy queues behind
the step's work instead of waiting for it; several tensors in one copy where a step builds many."""
from __future__ import annotations

from typing import Sequence

import torch

ALIGN = 16  # bytes: where every tensor in a packed copy starts, so that any dtype's view is aligned


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def packed(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes in one uint8 host buffer (pinned if ``pin``), and where each starts (a
    multiple of ``ALIGN``); each tensor's bytes are copied once, straight into their slice."""
    raws = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    offsets, end = [], 0
    for raw in raws:
        offsets.append(end)
        end += -(-raw.numel() // ALIGN) * ALIGN
    buffer = torch.zeros(end, dtype=torch.uint8, device="cpu", pin_memory=pin)
    for raw, o in zip(raws, offsets):
        buffer[o:o + raw.numel()].copy_(raw)
    return buffer, offsets


def unpacked(buffer: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` (``packed``'s, on any device) with the dtypes and shapes of ``like``."""
    return [buffer[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, like)]


def to_device_at_once(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``device`` through one copy to a GPU: their bytes ``packed`` into one pinned
    buffer, each then a view of its device copy (on the CPU: the tensors themselves)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    buffer, offsets = packed(tensors, pin=True)
    return unpacked(buffer.to(device, non_blocking=True), offsets, tensors)
