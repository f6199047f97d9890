"""Cross-layer KV sharing (Brandon et al., 2024): in each group of K consecutive layers one layer
computes K/V and the others attend with it; the readers' k_proj / v_proj are dropped.

Which layer supplies: the first of each group, or (``select="calib"``) the one whose K/V the
others' are best predicted from on captured activations.

How readers use it: ``fit="none"`` reads the supplier's K/V as they are; ``fit="calib"`` maps
them to the reader's own by least squares on captured activations and folds the maps into the
reader's other projections: per value head a ``head_dim x head_dim`` matrix into o_proj, per
key head and rotary pair a complex scalar into q_proj (see ``projections``).
"""
from __future__ import annotations

from typing import Literal

import torch

from attention_variants.attention_inputs import AttentionInputs
from attention_variants.projections import (
    augmented,
    fold_into_query,
    head_shape,
    heads,
    keys_normed_per_head,
    proj_key,
    store_augmented,
)
from foundation.architecture import KV_PROJECTIONS

SupplierSelect = Literal["first", "calib"]
ShareFit = Literal["none", "calib"]


def kv_groups(num_layers: int, group_size: int) -> list[list[int]]:
    return [list(range(s, min(s + group_size, num_layers))) for s in range(0, num_layers, group_size)]


def _tokens(calib: AttentionInputs, layer: int, with_bias: bool) -> torch.Tensor:
    x = calib.flat(layer).double()
    if with_bias:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x


@torch.no_grad()
def _kv(weights: dict, config: dict, calib: AttentionInputs, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-rotary keys (complex pairs ``[G, d/2, T]``) and values ``[G, d, T]`` on calibration tokens."""
    _, _, d = head_shape(config)
    x = _tokens(calib, layer, proj_key(layer, "k_proj", "bias") in weights)
    k = heads(augmented(weights, layer, "k_proj"), d) @ x.T  # [G, d, T]
    v = heads(augmented(weights, layer, "v_proj"), d) @ x.T
    return torch.complex(k[:, : d // 2], k[:, d // 2 :]), v


def _fit(reader: tuple, supplier: tuple) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Least-squares maps supplier -> reader: per pair complex scalars ``[G, d/2]`` and value
    matrices ``[G, d, d]``, with the relative residual (K and V averaged)."""
    (kr, vr), (ks, vs) = reader, supplier
    b = (kr * ks.conj()).sum(-1) / (ks.abs() ** 2).sum(-1).clamp_min(1e-30)
    k_res = ((kr - b.unsqueeze(-1) * ks).abs() ** 2).sum() / (kr.abs() ** 2).sum().clamp_min(1e-30)
    css = vs @ vs.transpose(1, 2)
    crs = vr @ vs.transpose(1, 2)
    a = torch.linalg.solve(css + 1e-8 * css.diagonal(dim1=1, dim2=2).mean() * torch.eye(css.shape[-1], dtype=css.dtype), crs.transpose(1, 2)).transpose(1, 2)
    v_res = ((vr - a @ vs) ** 2).sum() / (vr**2).sum().clamp_min(1e-30)
    return b, a, float(k_res + v_res) / 2


def _raw_error(reader: tuple, supplier: tuple) -> float:
    (kr, vr), (ks, vs) = reader, supplier
    k_err = ((kr - ks).abs() ** 2).sum() / (kr.abs() ** 2).sum().clamp_min(1e-30)
    v_err = ((vr - vs) ** 2).sum() / (vr**2).sum().clamp_min(1e-30)
    return float(k_err + v_err) / 2


def choose_suppliers(
    weights: dict, config: dict, group_size: int, select: SupplierSelect, fit: ShareFit,
    calib: AttentionInputs | None, kinds: list[str] | None = None,
) -> list[int]:
    """``kv_source_layers``: per layer, the layer whose K/V it reads.

    Groups never mix layer kinds (``kinds``: "full"/"sliding" per layer): a sliding layer cannot
    read a global layer's cache, so the groups are formed within each run of same-kind layers.

    ``first``: fixed groups ``[0, K), [K, 2K), ...``, each read from its first layer. ``calib``:
    the same number of groups of consecutive layers, at most K long, placed (by dynamic
    programming) to minimise the readers' relative K/V error on the calibration tokens. A reader
    can only read an earlier layer (its K/V must exist when it runs), so a group's supplier is
    always its first layer; calibration chooses where groups start.
    """
    n = int(config["num_hidden_layers"])
    kinds = kinds or ["full"] * n
    cost = _pair_cost(weights, config, calib, group_size, fit) if select == "calib" and group_size > 1 else None
    sources = list(range(n))
    for run in _runs(kinds):
        groups = [[run[0] + i for i in g] for g in kv_groups(len(run), group_size)]
        if cost is not None:
            local = {(r - run[0], s - run[0]): c for (r, s), c in cost.items() if r in run and s in run}
            groups = [[run[0] + i for i in g] for g in _best_groups(len(run), group_size, len(groups), local)]
        for group in groups:
            for i in group:
                sources[i] = group[0]
    return sources


def _runs(kinds: list[str]) -> list[list[int]]:
    """Maximal runs of consecutive layers of the same kind."""
    runs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if runs and kinds[runs[-1][-1]] == kind:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _pair_cost(weights: dict, config: dict, calib: AttentionInputs, group_size: int, fit: ShareFit) -> dict:
    """``{(reader, supplier): relative K/V error}`` for every supplier less than K layers back."""
    n = int(config["num_hidden_layers"])
    kv = {i: _kv(weights, config, calib, i) for i in range(n)}
    cost = {}
    for r in range(n):
        for s in range(max(0, r - group_size + 1), r):
            cost[(r, s)] = _fit(kv[r], kv[s])[2] if fit == "calib" else _raw_error(kv[r], kv[s])
    return cost


def _best_groups(n: int, size: int, count: int, cost: dict) -> list[list[int]]:
    """Split layers into ``count`` runs of at most ``size`` minimising the readers' summed cost."""
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(n + 1)]  # best[j][c]: layers [0, j) in c runs
    back = [[0] * (count + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for c in range(1, count + 1):
            for i in range(max(0, j - size), j):
                run = best[i][c - 1] + sum(cost[(r, i)] for r in range(i + 1, j))
                if run < best[j][c]:
                    best[j][c], back[j][c] = run, i
    groups, j = [], n
    for c in range(count, 0, -1):
        i = back[j][c]
        groups.append(list(range(i, j)))
        j = i
    return groups[::-1]


def share_kv(
    weights: dict[str, torch.Tensor], config: dict, sources: list[int], fit: ShareFit,
    calib: AttentionInputs | None,
) -> dict[str, torch.Tensor]:
    """Drop readers' k_proj / v_proj (after folding the fitted maps into q_proj / o_proj)."""
    out = dict(weights)
    n_heads, n_kv, d = head_shape(config)
    q_per_kv = n_heads // n_kv
    for r, s in enumerate(sources):
        if r == s:
            continue
        if fit == "calib":
            b, a, _ = _fit(_kv(weights, config, calib, r), _kv(weights, config, calib, s))
            if keys_normed_per_head(config):
                b = torch.ones_like(b)  # k_norm sits between k_proj and rotary: no scalar can move into q
            dtype = weights[proj_key(r, "q_proj")].dtype
            wq = heads(augmented(out, r, "q_proj"), d)
            wo = out[proj_key(r, "o_proj")].double().reshape(-1, n_heads, d)
            for h in range(n_heads):
                g = h // q_per_kv
                wq[h] = fold_into_query(wq[h], b[g])
                wo[:, h] = wo[:, h] @ a[g]
            store_augmented(out, r, "q_proj", wq.reshape(n_heads * d, -1), dtype)
            out[proj_key(r, "o_proj")] = wo.reshape(wo.shape[0], -1).to(dtype).contiguous()
        for proj in KV_PROJECTIONS:
            for param in ("weight", "bias"):
                out.pop(proj_key(r, proj, param), None)
    return out
