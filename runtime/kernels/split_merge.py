"""The merge of flash-decoding splits in one launch (vLLM's ``paged_attention_v2`` reduce step).

A split attention launch leaves, per split, each row's partial output normalised over the keys
it saw and that softmax's base-2 log-sum-exp (``paged_attention._store_output``). One program per
(token, head) weighs the partials by ``2^(lse - max lse)`` and writes the merged row in the
output's dtype; a row no split saw a key for (a padded row, context 0) is zeros, not NaN. The
torch definition it is tested against is ``paged_attention.merge_splits``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, head_dim,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(T, H)``: ``partial [splits, T, H, D]`` fp32, ``lse [splits, T, H]`` fp32 (base 2),
    ``out [T, H, D]``."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < head_dim
    lse = tl.load(lse_ptr + offs_s * stride_ls + tok * stride_lt + head, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)
    weights = tl.exp2(lse - top)  # 0 for a split that saw nothing
    total = tl.sum(weights, axis=0)
    weights = weights / tl.where(total > 0.0, total, 1.0)
    part = tl.load(partial_ptr + offs_s[:, None] * stride_ps + tok * stride_pt + head * stride_ph + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    merged = tl.sum(weights[:, None] * part, axis=0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


def merge_splits_into(lse: torch.Tensor, partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [T, H, D]`` (contiguous last dim) set to the merge of ``partial [splits, T, H, D]`` by
    ``lse [splits, T, H]`` (both fp32, as the attention launch leaves them); returns ``out``."""
    splits, T, H, D = partial.shape
    if T and H:
        merge_splits_kernel[(T, H)](
            partial, lse, out, D,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D),
        )
    return out
