"""Attention projection weights as stored in HF checkpoints, and the rotary-pair algebra.

Rotary embedding (HF layout, ``rotate_half``) rotates the dimension pairs ``(i, i + head_dim/2)``
of each head by the same angle in q and k. Treating a pair as a complex number ``a + jb``, a
rotation is a multiplication by ``exp(j phi)``, so multiplying a key pair by a complex scalar
``b`` commutes with it, and ``q . (b k) = (conj(b) q) . k`` lets that scalar move into ``q_proj``.
That is the only linear freedom K has under rotary, and what the calibrated merges use.
"""
from __future__ import annotations

import torch


def head_shape(config: dict) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` of a checkpoint's attention."""
    n_heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // n_heads)
    return n_heads, int(config["num_key_value_heads"]), head_dim


def keys_normed_per_head(config: dict) -> bool:
    """Whether k is RMS-normalised per head before rotary (Qwen3's ``k_norm``): its per-channel
    weights do not commute with a rotation of a rotary pair, so keys cannot be re-mixed freely."""
    return config.get("model_type") == "qwen3"


def rotated_qkv(attn, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers Llama-family attention's ``q [B, H, T, D]``, ``k`` and ``v [B, KVH, T, D]`` for
    input ``x [B, T, hidden]``, q and k rotated as the layer rotates them (Qwen3's per-head norms first)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, t, _ = x.shape
    d = attn.head_dim
    q = attn.q_proj(x).view(b, t, -1, d)
    k = attn.k_proj(x).view(b, t, -1, d)
    v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def proj_key(layer: int, proj: str, param: str = "weight") -> str:
    return f"model.layers.{layer}.self_attn.{proj}.{param}"


def augmented(weights: dict[str, torch.Tensor], layer: int, proj: str) -> torch.Tensor:
    """``[W | b]`` (fp64) for a projection, so ``W x + b = [W | b] [x; 1]``; ``W`` if it has no bias."""
    w = weights[proj_key(layer, proj)].double()
    bias = weights.get(proj_key(layer, proj, "bias"))
    return w if bias is None else torch.cat([w, bias.double().unsqueeze(1)], dim=1)


def store_augmented(weights: dict[str, torch.Tensor], layer: int, proj: str, w_aug: torch.Tensor, dtype) -> None:
    """Inverse of :func:`augmented`: write ``W`` (and the bias column, if the layer has one)."""
    if proj_key(layer, proj, "bias") in weights:
        weights[proj_key(layer, proj)] = w_aug[:, :-1].to(dtype).contiguous()
        weights[proj_key(layer, proj, "bias")] = w_aug[:, -1].to(dtype).contiguous()
    else:
        weights[proj_key(layer, proj)] = w_aug.to(dtype).contiguous()


def input_covariance(x: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """``E[x x^T]`` (fp64) over tokens ``x [T, D]``, augmented with a constant 1 when biases exist."""
    x = x.double()
    if with_bias:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x.T @ x / x.shape[0]


def heads(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k/v projection as ``[num_heads, head_dim, in]``."""
    return w.reshape(-1, head_dim, w.shape[-1])


def complex_pairs(w_head: torch.Tensor) -> torch.Tensor:
    """A head's rows ``[head_dim, in]`` as complex rotary pairs ``[head_dim/2, in]``."""
    half = w_head.shape[0] // 2
    return torch.complex(w_head[:half], w_head[half:])


def real_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`complex_pairs`."""
    return torch.cat([pairs.real, pairs.imag], dim=0)


def fold_into_query(q_head: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Query rows ``[head_dim, in]`` that see keys multiplied per pair by complex ``scale [head_dim/2]``."""
    return real_rows(complex_pairs(q_head) * scale.conj().unsqueeze(1))
