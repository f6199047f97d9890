"""Quantized KV blocks read out in one pass on the CPU: gather, unpack, scale and cast fused.

Eagerly, reading quantized blocks costs a pass over the gathered blocks per op, most of them in
fp32: for packed blocks the index, unpack's shifts and stack, the float copy, the scale, the
minimum and the cast; for FP8/INT8 rows the index, the float copy, the scale and the cast. On the
CPU that made INT4 decode at context 2,048 run at 0.29x of bf16, whose read is one gather of four
times the bytes. Compiled by inductor (dynamic in the number of blocks), the same function is one
C++ loop that reads each stored byte once and writes the result in the target dtype
(``benchmarks/cpu_kv_read.py``; whole decode steps: ``benchmarks/cpu_kv_decode.py``). The math is the
eager one, which stays the plain-torch reference the compiled read is tested against.

Compiled only for CPU tensors: a GPU reads quantized blocks in place in the Triton kernels, and its
torch path stays eager. Where compiling fails (no C++ compiler), a read warns once and runs eagerly;
``KVSLIM_EAGER_KV_READ=1`` asks for eager reads outright.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable

import torch

from runtime.cache.low_bit_kv import dequantize_keys, dequantize_values
from runtime.cache.paged_rows import gather_blocks

EAGER_ENV = "KVSLIM_EAGER_KV_READ"
# A variant is one (widths, dtypes) set, as dynamo guards on them; more than its default 8 per
# function could be asked by one process serving several checkpoints (and by the tests). Raised
# once, at the first compile, never lowered: a patch around every call would cost 18 us a read.
RECOMPILE_LIMIT = 64
# Inductor's note on fp16 parameters scaling into a bf16 result: the eager read mixes them the same way.
warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed in the scheduler node")


def _packed_keys(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, blocks: torch.Tensor, bits: int,
                 dtype: torch.dtype) -> torch.Tensor:
    return dequantize_keys(codes[blocks], scale[blocks], lo[blocks], bits, dtype)


def _packed_values(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, blocks: torch.Tensor, bits: int,
                   dtype: torch.dtype) -> torch.Tensor:
    return dequantize_values(codes[blocks], scale[blocks], lo[blocks], bits, dtype)


class CompiledOnCpu:
    """``fn`` compiled on its first CPU call; eager on any other device, when told, or once compiling
    failed. ``size_arg``: the position among ``fn``'s arguments of the one whose size a read follows
    (the block ids; below 2 elements the read runs eagerly)."""

    def __init__(self, fn: Callable[..., torch.Tensor], size_arg: int):
        self.fn = fn
        self.size_arg = size_arg
        self.compiled: Callable[..., torch.Tensor] | None = None
        self.failed = False

    def __call__(self, *args) -> torch.Tensor:
        # One element or none would make dynamo specialize the size (a recompile) for a read eager does at once.
        if (self.failed or args[0].device.type != "cpu" or args[self.size_arg].numel() < 2
                or os.environ.get(EAGER_ENV) == "1"):
            return self.fn(*args)
        if self.compiled is None:
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compile failure: the eager read is the same math
            self.failed = True
            first_line = (str(e).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"KV reads run eagerly: compiling them failed ({type(e).__name__}: {first_line})",
                          RuntimeWarning, stacklevel=2)
            return self.fn(*args)


read_packed_keys = CompiledOnCpu(_packed_keys, size_arg=3)
"""Key blocks ``blocks [n]`` of ``codes [num_blocks, block_size, kvh, Dp]`` (per-channel ``scale``,
``lo [num_blocks, kvh, D]``), ``bits``, ``dtype`` -> ``[n, block_size, kvh, D]`` in ``dtype``."""
read_packed_values = CompiledOnCpu(_packed_values, size_arg=3)
"""Value blocks ``blocks [n]`` (per-token ``scale``, ``lo [num_blocks, block_size, kvh]``)
-> ``[n, block_size, kvh, D]``."""
read_rows = CompiledOnCpu(gather_blocks, size_arg=2)
"""``gather_blocks(cache, scale, blocks, dtype)``: FP8/INT8 rows dequantized (bf16 rows are one gather either way)."""
