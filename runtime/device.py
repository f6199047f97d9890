"""Where the runtime runs, decided once: the device, the kernels, and on CUDA the KV budget.

    placement = Placement.resolve("auto", "auto")   # cuda + triton when a GPU is there, else cpu + torch

``load_model(..., placement=...)`` puts the decoder there; the engine, its KV cache, the step's
metadata and the sampling generators follow the model's device (``Engine.device``). ``triton`` on
the CPU runs Triton's interpreter (``TRITON_INTERPRET=1``; fp32 only, slow): the way CI proves the
GPU path's kernels without a GPU. ``triton`` is imported lazily, by the kernels that use it.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch

from foundation.errors import KvslimError
from runtime.device_choices import DEVICES, KERNELS


@dataclass(frozen=True)
class Placement:
    """The device and the kernel family (``torch``: torch's ops and the plain references;
    ``triton``: the Triton kernels for quantized Linears, KV stores and paged attention)."""

    device: torch.device
    kernels: Literal["torch", "triton"]

    @property
    def triton_interpreted(self) -> bool:
        return self.kernels == "triton" and self.device.type == "cpu"

    def describe(self) -> str:
        interpreted = " (Triton's interpreter)" if self.triton_interpreted else ""
        return f"{self.device.type}, {self.kernels} kernels{interpreted}"

    @classmethod
    def resolve(cls, device: str = "auto", kernels: str = "auto") -> "Placement":
        """``auto`` device: cuda when torch sees one, else cpu; ``auto`` kernels: triton on cuda
        (when installed), torch on cpu. One line for a request this machine cannot honour."""
        if device not in DEVICES:
            raise KvslimError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        if kernels not in KERNELS:
            raise KvslimError(f"unknown kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
        cuda = torch.cuda.is_available()
        if device == "cuda" and not cuda:
            raise KvslimError("--device cuda: no CUDA device is available to torch on this machine")
        dev = torch.device("cuda" if device == "cuda" or (device == "auto" and cuda) else "cpu")
        has_triton = importlib.util.find_spec("triton") is not None
        if kernels == "auto":
            kernels = "triton" if dev.type == "cuda" and has_triton else "torch"
        if kernels == "triton" and not has_triton:
            raise KvslimError("--kernels triton: triton is not installed (pip install triton)")
        if kernels == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise KvslimError("--kernels triton on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 "
                              "(slow, fp32; for checking the GPU path without a GPU)")
        return cls(dev, kernels)


CPU = Placement(torch.device("cpu"), "torch")


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes for the KV cache on ``device``: what is left of ``utilization`` x the device's memory
    once the model (already loaded) and what else holds memory there are counted, as vLLM's
    ``--gpu-memory-utilization`` means it."""
    if not 0 < utilization <= 1:
        raise KvslimError(f"--gpu-memory-utilization {utilization} must be in (0, 1]")
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free)
    if budget <= 0:
        raise KvslimError(f"--gpu-memory-utilization {utilization}: {(total - free) >> 20} MiB of "
                          f"{total >> 20} MiB are already in use; nothing is left for the KV cache")
    return budget
