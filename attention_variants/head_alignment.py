"""KV heads grouped by similarity and aligned before they are merged (align-then-merge, MHA -> GQA).

Everything here is exact: the model computes the same function afterwards, only the order and the
basis of its KV heads change, so a following mean-pool merges heads that look alike.

- Grouping: heads are compared on calibration activations after the best alignment of each pair
  (the similarities below) and grouped greedily: each group starts at the first head left and
  takes the ``m - 1`` remaining heads most similar to it. A KV head moves with the query heads
  that read it (rows of q_proj, columns of o_proj), so the permutation changes nothing.
- V: each head of a group is rotated onto the group's reference head (the member most similar to
  the others) by orthogonal Procrustes: ``R = U W^T`` from the SVD ``E[v_g v_r^T] = U S W^T``,
  ``v_g <- R^T v_g``, and the readers' o_proj slices take ``o_h <- o_h R``.
- K: per rotary pair, the unit complex phase ``b`` that best aligns the pair ``z_g`` with ``z_r``
  (``b = s / |s|``, ``s = E[z_r conj(z_g)]``): a 2x2 rotation, which commutes with RoPE; the
  readers' q_proj rows fold the inverse, so ``q . k`` is unchanged. Models that normalise k per
  head before rotary (Qwen3's ``k_norm``) keep their keys: a phase does not commute with the
  norm's per-channel weights.

Similarity of two heads: the share of their energy that the best alignment matches,
``||E[v_g v_h^T]||_* / sqrt(E|v_g|^2 E|v_h|^2)`` for V, ``sum_p |s_p| / sqrt(E|z_g|^2 E|z_h|^2)``
for K, averaged (1 for heads that are rotations of each other).
"""
from __future__ import annotations

import torch

from attention_variants.projections import (
    augmented,
    complex_pairs,
    fold_into_query,
    head_shape,
    heads,
    input_covariance,
    keys_normed_per_head,
    proj_key,
    real_rows,
    store_augmented,
)


def align_kv_heads(weights: dict[str, torch.Tensor], config: dict, num_kv_heads: int, inputs: list[torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """Return weights whose KV heads are grouped by similarity into ``num_kv_heads`` consecutive
    groups and aligned within each group; ``inputs[l]`` are layer l's attention inputs ``[T, hidden]``."""
    out = dict(weights)
    for layer, x in enumerate(inputs):
        _align_layer(out, config, layer, num_kv_heads, x)
    return out


def similarity_groups(similarity: torch.Tensor, num_groups: int) -> list[list[int]]:
    """Greedy grouping of ``[G, G]`` similarities into ``num_groups`` groups of equal size."""
    size = similarity.shape[0] // num_groups
    left = list(range(similarity.shape[0]))
    groups = []
    while left:
        seed = left.pop(0)
        ranked = sorted(left, key=lambda h: -float(similarity[seed, h]))
        group = [seed, *ranked[: size - 1]]
        left = [h for h in left if h not in group]
        groups.append(sorted(group))
    return groups


def _align_layer(w: dict, config: dict, layer: int, new_kv: int, x: torch.Tensor) -> None:
    n_heads, old_kv, d = head_shape(config)
    q_per_kv = n_heads // old_kv
    align_keys = not keys_normed_per_head(config)
    dtype = w[proj_key(layer, "k_proj")].dtype
    sigma = input_covariance(x, proj_key(layer, "k_proj", "bias") in w)
    wq = heads(augmented(w, layer, "q_proj"), d)  # [H, d, in]
    wk = heads(augmented(w, layer, "k_proj"), d)  # [G, d, in]
    wv = heads(augmented(w, layer, "v_proj"), d)
    wo = w[proj_key(layer, "o_proj")].double().reshape(-1, n_heads, d)  # [out, H, d]

    sim = _similarity(wk, wv, sigma, align_keys)
    groups = similarity_groups(sim, new_kv)
    order = [g for group in groups for g in group]
    readers = [h for g in order for h in range(g * q_per_kv, (g + 1) * q_per_kv)]
    wk, wv, wq, wo = wk[order], wv[order], wq[readers], wo[:, readers]
    sim = sim[order][:, order]

    m = old_kv // new_kv
    for j in range(new_kv):
        members = list(range(j * m, (j + 1) * m))
        ref = max(members, key=lambda g: float(sim[g, members].sum()))
        for g in members:
            if g == ref:
                continue
            reads = range(g * q_per_kv, (g + 1) * q_per_kv)
            u, _, vh = torch.linalg.svd(wv[g] @ sigma @ wv[ref].T)
            rot = u @ vh  # maximises E[(R^T v_g) . v_r]
            wv[g] = rot.T @ wv[g]
            for h in reads:
                wo[:, h] = wo[:, h] @ rot
            if align_keys:
                zg, zr = complex_pairs(wk[g]), complex_pairs(wk[ref])
                s = torch.einsum("pi,ij,pj->p", zr, sigma.to(zr.dtype), zg.conj())
                phase = torch.where(s.abs() > 0, s / s.abs().clamp_min(1e-300), torch.ones_like(s))
                wk[g] = real_rows(zg * phase.unsqueeze(1))
                for h in reads:
                    wq[h] = fold_into_query(wq[h], phase.conj())
    store_augmented(w, layer, "q_proj", wq.reshape(n_heads * d, -1), dtype)
    store_augmented(w, layer, "k_proj", wk.reshape(old_kv * d, -1), dtype)
    store_augmented(w, layer, "v_proj", wv.reshape(old_kv * d, -1), dtype)
    w[proj_key(layer, "o_proj")] = wo.reshape(wo.shape[0], n_heads * d).to(dtype).contiguous()


def _similarity(wk: torch.Tensor, wv: torch.Tensor, sigma: torch.Tensor, with_keys: bool) -> torch.Tensor:
    """``[G, G]`` share of two heads' energy their best alignment matches (module docstring)."""
    cov_v = torch.einsum("gdi,ij,hej->ghde", wv, sigma, wv)  # E[v_g v_h^T]
    energy_v = torch.einsum("ggdd->g", cov_v)
    sim = torch.linalg.matrix_norm(cov_v, ord="nuc") / (energy_v[:, None] * energy_v[None, :]).sqrt().clamp_min(1e-300)
    if not with_keys:
        return sim
    pairs = torch.stack([complex_pairs(k) for k in wk])  # [G, d/2, in]
    s = torch.einsum("gpi,ij,hpj->ghp", pairs, sigma.to(pairs.dtype), pairs.conj())  # E[z_g conj(z_h)]
    energy_k = torch.einsum("ggp->g", s).real
    sim_k = s.abs().sum(-1) / (energy_k[:, None] * energy_k[None, :]).sqrt().clamp_min(1e-300)
    return (sim + sim_k) / 2
