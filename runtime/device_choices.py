"""The devices and kernel families a user may ask for, torch-free (the CLI's parsers read them)."""
from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("auto", "torch", "triton")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEVICE_HELP = "where the model and its KV cache run: auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda"
KERNELS_HELP = ("auto (default: triton on cuda, torch on cpu), torch, or triton (on the CPU: Triton's interpreter "
                "with TRITON_INTERPRET=1; fp32, slow, for checking the GPU path)")
GPU_MEMORY_HELP = ("on CUDA without --kv-cache-mib: the share of the GPU's memory the model, activations and KV "
                   "cache may use (default 0.9)")
