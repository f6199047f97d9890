"""GQA / MQA: merge each group of KV heads into one.

Three merges:

- ``mean``: mean-pool the group's k_proj / v_proj rows (Ainslie et al., 2023).
- ``aligned``: group the heads by similarity and align them (``head_alignment``: orthogonal
  Procrustes for V, a phase per rotary pair for K, both exact), then mean-pool: align-then-merge.
- ``calib``: fitted on captured attention inputs.
  V: the group's values ``Y = [W_v,g x]_g`` are approximated by ``A_g V'`` with a shared head
  ``V' = W' x``: a reduced-rank regression solved by the top ``head_dim`` eigenvectors of the
  values' covariance, weighted per head by ``sum_h o_h^T o_h`` of the query heads that read it;
  each ``A_g`` is absorbed into those heads' slices of o_proj (values are not rotated, so this is
  exact for any linear ``A_g``).
  K: per rotary pair, the group's keys ``z_g`` (complex) are approximated by ``b_g z'`` with a
  complex scalar ``b_g`` (the only maps that commute with rotary), a rank-1 fit weighted by the
  reading queries' energy on that pair; ``conj(b_g)`` is folded into those queries' q_proj rows.
  Models that normalise k per head before rotary (Qwen3's ``k_norm``) keep the mean for K.
  The fitted maps absorb any rotation of a head, so aligning heads first changes nothing here.
"""
from __future__ import annotations

from typing import Literal

import torch

from attention_variants.attention_inputs import AttentionInputs
from attention_variants.head_alignment import align_kv_heads
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
from foundation.architecture import KV_PROJECTIONS

MergeMethod = Literal["mean", "aligned", "calib"]
MERGE_METHODS = ("mean", "aligned", "calib")


def merge_kv_heads(
    weights: dict[str, torch.Tensor],
    config: dict,
    num_kv_heads: int,
    method: MergeMethod,
    calib: AttentionInputs | None = None,
) -> dict[str, torch.Tensor]:
    """Return new weights with ``num_kv_heads`` KV heads per layer (validated by the caller)."""
    n_layers = int(config["num_hidden_layers"])
    if method == "aligned":
        weights = align_kv_heads(weights, config, num_kv_heads, [calib.flat(layer) for layer in range(n_layers)])
        method = "mean"
    out = dict(weights)
    for layer in range(n_layers):
        if method == "mean":
            _mean_merge(out, config, layer, num_kv_heads)
        else:
            _calib_merge(out, config, layer, num_kv_heads, calib.flat(layer))
    return out


def _mean_merge(w: dict, config: dict, layer: int, new_kv: int) -> None:
    _, old_kv, head_dim = head_shape(config)
    for proj in KV_PROJECTIONS:
        for param in ("weight", "bias"):
            key = proj_key(layer, proj, param)
            if key in w:
                t = w[key]
                grouped = t.reshape(new_kv, old_kv // new_kv, head_dim, *t.shape[1:])
                w[key] = grouped.mean(dim=1).reshape(new_kv * head_dim, *t.shape[1:]).contiguous()


def _psd_sqrt(m: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root of a PSD matrix and its inverse (eigenvalues floored at ``eps * max``)."""
    vals, vecs = torch.linalg.eigh(m)
    vals = vals.clamp_min(eps * float(vals.max().clamp_min(1e-30)))
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def _calib_merge(w: dict, config: dict, layer: int, new_kv: int, x: torch.Tensor) -> None:
    n_heads, old_kv, d = head_shape(config)
    m = old_kv // new_kv  # old KV heads per new one
    q_per_kv = n_heads // old_kv
    dtype = w[proj_key(layer, "k_proj")].dtype
    has_bias = proj_key(layer, "k_proj", "bias") in w
    sigma = input_covariance(x, has_bias)
    wq = heads(augmented(w, layer, "q_proj"), d)  # [H, d, in]
    wk = heads(augmented(w, layer, "k_proj"), d)  # [G, d, in]
    wv = heads(augmented(w, layer, "v_proj"), d)
    wo = w[proj_key(layer, "o_proj")].double().reshape(-1, n_heads, d)  # [out, H, d]
    new_k, new_v = [], []
    qk_norm = keys_normed_per_head(config)
    for j in range(new_kv):
        group = list(range(j * m, (j + 1) * m))
        readers = {g: list(range(g * q_per_kv, (g + 1) * q_per_kv)) for g in group}
        # --- V: weighted reduced-rank regression, corrections absorbed into o_proj.
        roots = [_psd_sqrt(sum(wo[:, h].T @ wo[:, h] for h in readers[g]), 1e-6) for g in group]
        stacked = torch.cat([roots[i][0] @ wv[g] for i, g in enumerate(group)])  # [m*d, in]
        _, vecs = torch.linalg.eigh(stacked @ sigma @ stacked.T)
        u = vecs[:, -d:]  # top-d eigenvectors, [m*d, d]
        new_v.append(u.T @ stacked)
        for i, g in enumerate(group):
            a_g = roots[i][1] @ u[i * d : (i + 1) * d]  # old value head g ~= a_g @ shared head
            for h in readers[g]:
                wo[:, h] = wo[:, h] @ a_g
        # --- K: per rotary pair, a rank-1 complex fit weighted by the queries' energy.
        if qk_norm:
            new_k.append(wk[group].mean(dim=0))
            continue
        pairs = torch.stack([complex_pairs(wk[g]) for g in group])  # [m, d/2, in]
        sig_c = sigma.to(pairs.dtype)
        q_energy = torch.stack([
            sum(((complex_pairs(wq[h]) @ sig_c) * complex_pairs(wq[h]).conj()).real.sum(-1) for h in readers[g])
            for g in group
        ]).clamp_min(1e-12)  # [m, d/2]: E|q_pair|^2 summed over the group's readers
        scale = q_energy.sqrt()
        cov = torch.einsum("gpi,ij,hpj->pgh", pairs, sig_c, pairs.conj())  # [d/2, m, m] = E[z_g conj(z_h)]
        cov = scale.T.unsqueeze(2) * cov * scale.T.unsqueeze(1)
        _, evecs = torch.linalg.eigh(cov)
        top = evecs[:, :, -1]  # [d/2, m]
        shared = torch.einsum("pg,pg,gpi->pi", top.conj(), scale.T.to(top.dtype), pairs)  # [d/2, in]
        new_k.append(real_rows(shared))
        for i, g in enumerate(group):
            b_g = top[:, i] / scale[i]
            for h in readers[g]:
                wq[h] = fold_into_query(wq[h], b_g)
    store_augmented(w, layer, "q_proj", wq.reshape(n_heads * d, -1), dtype)
    store_augmented(w, layer, "k_proj", torch.cat(new_k), dtype)
    store_augmented(w, layer, "v_proj", torch.cat(new_v), dtype)
    w[proj_key(layer, "o_proj")] = wo.reshape(wo.shape[0], n_heads * d).to(dtype).contiguous()
