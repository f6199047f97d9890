"""Host tensors to the device: from pinned memory and non-blocking on CUDA, so a copy queues behind
the step's work instead of waiting for it; several tensors in one copy where a step builds many."""
from __future__ import annotations

from typing import Sequence

import torch

ALIGN = 16  # bytes: where every tensor in a packed copy starts, so that any dtype's view is aligned


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def packed(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes in one uint8 buffer, and where each starts (a multiple of ``ALIGN``)."""
    parts, offsets, end = [], [], 0
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        offsets.append(end)
        parts.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8))
        end += raw.numel() + pad
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)), offsets


def unpacked(buffer: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` (``packed``'s, on any device) with the dtypes and shapes of ``like``."""
    return [buffer[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, like)]


def to_device_at_once(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``device`` through one copy to a GPU: their bytes ``packed`` into one pinned
    buffer, each then a view of its device copy (on the CPU: the tensors themselves)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    buffer, offsets = packed(tensors)
    return unpacked(to_device(buffer, device), offsets, tensors)
