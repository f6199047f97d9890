"""Rotary position embeddings (rotate-half, as transformers applies them), and one layer's key
rotation as the attention backend applies it.

The decoder rotates queries; keys reach the backend *before* rotary, with their layer's
``KeyRope``, because the cache layout decides when a key is rotated: most layouts store keys
rotated (the backend rotates them on write), while int2 and k3v2 KV store them before RoPE and rotate
each key read after dequantizing it (KVQuant: a key channel keeps its scale across a block only
before RoPE mixes channel pairs at every position's own angle).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch

from runtime.cache.compiled_kv_read import CompiledOnCpu


def rope_frequencies(rope: Any, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] fp32, attention_scaling)`` for one rope (a ``RopeSpec``).

    Scaled rope types (linear, llama3, yarn, longrope) use transformers' own initialisers, so the
    frequencies are the library's by construction.
    """
    if rope.rope_type == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (rope.theta**exponent), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope.as_dict(),
    )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](cfg, None)
    return inv_freq.float(), float(scaling)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions ``[...]`` -> ``(cos, sin)`` each ``[..., head_dim]`` in ``dtype`` (angles in fp32)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # a no-op when already there
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., heads, head_dim]``; cos/sin broadcastable to it (``[..., 1, head_dim]``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotated_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """Keys ``[..., kv_heads, head_dim]`` at ``positions [...]`` rotated in fp32, returned in ``dtype``."""
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling, torch.float32)
    return apply_rotary(k.float(), cos.unsqueeze(-2), sin.unsqueeze(-2)).to(dtype)


def _rotated_by_table(k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """``rotated_keys`` with cos/sin looked up in tables of every position (``KeyRope.cos_sin_table``)."""
    return apply_rotary(k.float(), cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)).to(dtype)


_read_rotated = CompiledOnCpu(_rotated_by_table, size_arg=1)


@dataclass(frozen=True)
class KeyRope:
    """One layer's key rotation: its rope's frequencies and attention scaling."""

    inv_freq: tuple[float, ...]  # [head_dim / 2]
    scaling: float = 1.0

    @classmethod
    def of(cls, rope: Any, head_dim: int, max_position_embeddings: int) -> "KeyRope":
        inv_freq, scaling = rope_frequencies(rope, head_dim, max_position_embeddings)
        return cls(tuple(inv_freq.tolist()), scaling)

    @cached_property
    def inv_freq_tensor(self) -> torch.Tensor:
        return torch.tensor(self.inv_freq, dtype=torch.float32, device="cpu")  # copied per device by inv_freq_on

    @cached_property
    def _inv_freq_by_device(self) -> dict[torch.device, torch.Tensor]:
        return {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` as an fp32 tensor on ``device`` (copied there once)."""
        device = torch.device(device)
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self.inv_freq_tensor.to(device)
        return self._inv_freq_by_device[device]

    @cached_property
    def _tables_by_device(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def cos_sin_table(self, device: torch.device, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin) [n, head_dim]`` of positions ``0 .. n - 1``, ``n >= length``, scaling
        applied, as ``rotary_cos_sin`` computes them: kept per device, grown by doubling."""
        device = torch.device(device)
        table = self._tables_by_device.get(device)
        if table is None or table[0].shape[0] < length:
            n = max(256, 1 << (length - 1).bit_length())
            positions = torch.arange(n, device=device)
            table = rotary_cos_sin(positions, self.inv_freq_on(device), self.scaling, torch.float32)
            self._tables_by_device[device] = table
        return table

    def rotate(self, k: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Cached keys ``[..., kv_heads, head_dim]`` at ``positions [...]`` rotated in fp32, returned in
        ``dtype`` (default k's; the read of a layout that stores keys before RoPE): cos/sin looked up
        per position, on the CPU in one compiled pass (``compiled_kv_read``); ``rotated_keys`` is the
        eager reference, computing them (and the path off the CPU, where a table's length would cost a sync)."""
        dtype = dtype or k.dtype
        if positions.device.type != "cpu":
            return rotated_keys(k, positions, self.inv_freq_on(positions.device), self.scaling, dtype)
        cos, sin = self.cos_sin_table(positions.device, int(positions.max()) + 1 if positions.numel() else 1)
        return _read_rotated(k, positions, cos, sin, dtype)


class StepKeyRotary:
    """Rotates one step's new keys exactly as the decoder rotates its queries (cos/sin rounded to
    the keys' dtype first), computing cos/sin once per step for each rope. ``rotate``: the
    rotation, ``apply_rotary`` or a kernel with its numerics (``runtime.kernels.rotary``)."""

    def __init__(self, positions: torch.Tensor, rotate: Callable[..., torch.Tensor] | None = None):
        self.positions = positions  # [T]
        self.rotate = rotate or apply_rotary
        self._cos_sin: dict[tuple[KeyRope, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def share(self, tables: dict[tuple[KeyRope, torch.dtype], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take the decoder's cos/sin ``[T, 1, head_dim]`` per (rope, dtype) for this step's positions,
        so queries and keys rotate by one table, computed once."""
        self._cos_sin.update(tables)

    def __call__(self, rope: KeyRope | None, k: torch.Tensor) -> torch.Tensor:
        """New keys ``[T, kv_heads, head_dim]`` before rotary -> rotated (unchanged without a rope)."""
        if rope is None:
            return k
        key = (rope, k.dtype)
        if key not in self._cos_sin:
            cos, sin = rotary_cos_sin(self.positions, rope.inv_freq_on(self.positions.device), rope.scaling, k.dtype)
            self._cos_sin[key] = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self.rotate(k, *self._cos_sin[key])
