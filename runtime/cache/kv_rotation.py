"""The rotated bases a packed cache keeps keys or values in (QuaRot's randomized Hadamard).

Values: a value row is quantized per token over head_dim, so its few large coordinates stretch the
row's four 2-bit levels over the rest; an orthonormal rotation spreads every coordinate over all of
them. Attention is linear in the values (``softmax(qK^T) V R = (softmax(qK^T) V) R``), so it runs in
the rotated basis: a layer's values are rotated on their way in (the step's exact rows too, so every
row a read mixes shares the basis) and the attention output is rotated back, per query head.

Keys: scores are inner products, ``(q R)(k R)^T = q k^T``, so a layer's keys (after RoPE) and its
queries are rotated alike and the scores are unchanged, exact rows and quantized ones.

The kernels are untouched; a step costs two ``[T, heads, D] x [D, D]`` products per layer and part.
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


class KvRotation:
    """A cache group's basis, shared by its layers: ``rotate`` values (or keys and queries) in,
    ``restore`` attention outputs over rotated values."""

    def __init__(self, head_dim: int, device: torch.device | str) -> None:
        self.matrix = randomized_hadamard(head_dim).to(device)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Values, keys or queries ``[..., D]`` into the cache's basis (fp32 product, ``x``'s dtype)."""
        return (x.float() @ self.matrix).to(x.dtype)

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output ``[..., D]`` over rotated values back to the model's basis."""
        return (out.float() @ self.matrix.T).to(out.dtype)
