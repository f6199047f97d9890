"""Values of a 2-bit cache kept in a rotated basis (QuaRot's randomized Hadamard, for V).

A value row is quantized per token over head_dim, so its few large coordinates stretch the row's
four levels over the rest. An orthonormal rotation spreads every coordinate over all of them.
Attention is linear in the values (``softmax(qK^T) V R = (softmax(qK^T) V) R``), so it runs in the
rotated basis: a layer's values are rotated on their way in (the step's exact rows too, so every
row a read mixes shares the basis) and the attention output is rotated back, per query head. The
kernels are untouched; a step costs two ``[T, heads, D] x [D, D]`` products per layer.

The rotation lives only in the running cache (never written to a checkpoint), so its random signs
need only be the same for a cache's writes and reads.
"""
from __future__ import annotations

import math

import torch

SEED = 0


def randomized_hadamard(d: int, seed: int = SEED) -> torch.Tensor:
    """An orthonormal fp32 ``[d, d]`` matrix: Sylvester's Hadamard with random column signs when
    ``d`` is a power of two, else a random orthogonal matrix (QR of a Gaussian)."""
    gen = torch.Generator().manual_seed(seed)
    if d & (d - 1):
        q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.float64) * 2 - 1
    return (h * signs / math.sqrt(d)).float()


class ValueRotation:
    """A cache group's value basis, shared by its layers: ``rotate`` values in, ``restore`` attention outputs."""

    def __init__(self, head_dim: int, device: torch.device | str) -> None:
        self.matrix = randomized_hadamard(head_dim).to(device)

    def rotate(self, v: torch.Tensor) -> torch.Tensor:
        """Values ``[..., D]`` into the cache's basis (fp32 product, ``v``'s dtype)."""
        return (v.float() @ self.matrix).to(v.dtype)

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output ``[..., D]`` over rotated values back to the model's basis."""
        return (out.float() @ self.matrix.T).to(out.dtype)
