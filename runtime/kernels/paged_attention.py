"""Paged attention over a (possibly FP8/INT8) KV cache: decode, prefill and extend in one kernel.

Shapes (one cache group; layers that share KV simply pass the owner's cache tensors):
- ``q`` ``[T, H, D]``: the step's new tokens, flattened over sequences (``attention_backend``).
- ``k_cache``, ``v_cache`` ``[num_blocks, block_size, KVH, D]`` bf16/fp16/fp32/float8_e4m3fn/int8;
  quantized caches carry ``k_scale``/``v_scale`` ``[num_blocks, block_size, KVH]`` fp32 or a
  one-element fp32 tensor (see ``kv_store``). The step's new K/V must already be stored; over a
  quantized cache they may also be given (``k``, ``v`` ``[T, KVH, D]``) to be read exact.
- ``block_tables`` int32 ``[S, max_blocks]``, ``context_lens`` int32 ``[S]`` (tokens cached per
  sequence, new ones included), ``query_start_loc`` int32 ``[S + 1]`` (sequence s owns q rows
  ``query_start_loc[s]:query_start_loc[s+1]``, its last ``q_len`` positions).
- Returns ``[T, H, D]`` in q's dtype.

Query at position p attends cached positions j with ``j <= p`` and, with a window W,
``p - W < j`` or, with S attention sinks, ``j < S`` (the first split of a query tile also reads
the sink keys below its window range). GQA/MQA: q head h reads KV head ``h // (H / KVH)``; a
program handles all the q heads of one KV head so each K/V tile is read once. Long decodes split the context across
programs (flash-decoding) and merge the partial softmaxes.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError
from runtime.attention.backend import reference_attention
from runtime.cache.paged_rows import gather_blocks
from runtime.kernels.kv_store import (
    check_kv_cache,
    check_kv_scales,
    scales_per_token,
)
from runtime.kernels.split_merge import merge_splits_into

SPLIT_MIN_TOKENS = 256  # a decode split covers at least this many cached tokens


@triton.jit
def _query_rows(context_lens_ptr, seq, q_block, kvh, q_len, QPK: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_Q: tl.constexpr):
    """Rows of the ``[BLOCK_M, D]`` query tile are (token, head-in-group) pairs: row r = token
    ``r // QPK``, head ``r % QPK``. Returns the context length and, per row: token, head,
    validity and position."""
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // QPK
    head = kvh * QPK + rows % QPK
    row_ok = (rows // QPK < BLOCK_Q) & (tok < q_len)
    q_pos = ctx - q_len + tok
    return ctx, tok, head, row_ok, q_pos


@triton.jit
def _split_range(ctx, q_len, q_block, split, window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, ALIGN: tl.constexpr):
    """Keys this tile of queries can see, then this program's share of them: ``[lo, hi)``;
    ``ALIGN``: lo rounded down to a multiple of BLOCK_N (keys below the window are masked)."""
    first_pos = ctx - q_len  # position of the sequence's first new token
    hi = tl.minimum(ctx, first_pos + (q_block + 1) * BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0)
        if ALIGN:
            lo = lo // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = lo + split * per_split
    return split_lo, tl.minimum(hi, split_lo + per_split)


@triton.jit
def _sink_tiles(split, split_lo, sinks, BLOCK_N: tl.constexpr, USE_SINKS: tl.constexpr):
    """``(tiles, end)``: the sink keys ``[0, end)`` below the window range that this program
    reads first (split 0 only, whose range starts at the window's), in tiles of BLOCK_N."""
    end = 0
    if USE_SINKS:
        if split == 0:
            end = tl.minimum(sinks, split_lo)
    return tl.cdiv(end, BLOCK_N), end


@triton.jit
def _tile_start(t, sink_tiles, sink_end, split_lo, split_hi, BLOCK_N: tl.constexpr):
    """First key and end of tile ``t``: the sink tiles, then the window range's."""
    sink = t < sink_tiles
    return tl.where(sink, t * BLOCK_N, split_lo + (t - sink_tiles) * BLOCK_N), tl.where(sink, sink_end, split_hi)


@triton.jit
def _attend_tile(q, k, v, m_i, l_i, acc, offs_j, j_ok, q_pos, row_ok, sm_scale, softcap, window, sinks,
                 USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 SKIP_OWN: tl.constexpr = False):
    """One online-softmax step over a ``[BLOCK_N, D]`` tile of keys and values at ``offs_j``;
    ``SKIP_OWN``: no row attends the key at its own position here (``_attend_own`` adds it)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale
    if USE_SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # softcap * tanh(s / softcap)
    allowed = row_ok[:, None] & j_ok[None, :] & (offs_j[None, :] <= q_pos[:, None])
    if SKIP_OWN:
        allowed = allowed & (offs_j[None, :] != q_pos[:, None])
    if USE_WINDOW:
        in_window = q_pos[:, None] - offs_j[None, :] < window
        if USE_SINKS:
            in_window = in_window | (offs_j[None, :] < sinks)
        allowed = allowed & in_window
    s = tl.where(allowed, s * 1.4426950408889634, float("-inf"))  # log2(e): softmax in base 2
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc


@triton.jit
def _attend_own(q, k_own, v_own, m_i, l_i, acc, row_ok, sm_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """One online-softmax step over one key per row: each row's own ``k_own``/``v_own`` ``[BLOCK_M, D]``."""
    s = tl.sum(q.to(tl.float32) * k_own, axis=1) * sm_scale
    if USE_SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(row_ok, s * 1.4426950408889634, float("-inf"))
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v_own


@triton.jit
def _store_output(out_ptr, lse_ptr, acc, m_i, l_i, split, q_start, tok, head, row_ok, offs_d, d_ok,
                stride_ot, stride_oh, stride_osplit, stride_lt, stride_lsplit, NUM_SPLITS: tl.constexpr):
    """Normalise and store this program's rows (and, split, their base-2 log-sum-exp)."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + split * stride_osplit + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * stride_lsplit + (q_start + tok) * stride_lt + head, lse, mask=row_ok)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, k_new_ptr, v_new_ptr,
    block_tables_ptr, context_lens_ptr, query_start_ptr, out_ptr, lse_ptr,
    sm_scale, softcap, window, sinks, block_size,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt, stride_nt, stride_nh,
    stride_ot, stride_oh, stride_osplit, stride_lt, stride_lsplit,
    QPK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    KV_QUANT: tl.constexpr, SCALE_PER_TOKEN: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr = False, FRESH: tl.constexpr = False, OWN_ROW: tl.constexpr = False,
):
    """Grid ``(S, cdiv(max_q_len, BLOCK_Q), KVH * NUM_SPLITS)`` (query tile rows: ``_query_rows``).
    ``FRESH`` (quantized caches): keys at positions ``>= ctx - q_len``, the step's own, are read
    exact from ``k_new``/``v_new`` ``[T, KVH, D]`` instead of the cache. ``OWN_ROW`` (instead):
    each row reads only the key at its own position exact from there, as a decode step would."""
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    ctx, tok, head, row_ok, q_pos = _query_rows(context_lens_ptr, seq, q_block, kvh, q_len, QPK, BLOCK_M, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    split_lo, split_hi = _split_range(ctx, q_len, q_block, split, window, BLOCK_Q, BLOCK_N, NUM_SPLITS, USE_WINDOW,
                                      False)

    if KV_QUANT:
        if not SCALE_PER_TOKEN:
            k_scalar = tl.load(k_scale_ptr)
            v_scalar = tl.load(v_scale_ptr)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    sink_tiles, sink_end = _sink_tiles(split, split_lo, sinks, BLOCK_N, USE_SINKS)
    first_new = ctx - q_len  # FRESH: the position of the step's first own row
    for t in range(0, sink_tiles + tl.cdiv(split_hi - split_lo, BLOCK_N)):
        j0, j_end = _tile_start(t, sink_tiles, sink_end, split_lo, split_hi, BLOCK_N)
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_ok = offs_j < j_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + offs_j // block_size, mask=j_ok, other=0).to(tl.int64)
        slot_off = blk * stride_cb + (offs_j % block_size) * stride_cs + kvh * stride_ch
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            if SCALE_PER_TOKEN:
                s_off = blk * stride_sb + (offs_j % block_size) * stride_ss + kvh
                k = k.to(tl.float32) * tl.load(k_scale_ptr + s_off, mask=j_ok, other=0.0)[:, None]
                v = v.to(tl.float32) * tl.load(v_scale_ptr + s_off, mask=j_ok, other=0.0)[:, None]
            else:
                k = k.to(tl.float32) * k_scalar
                v = v.to(tl.float32) * v_scalar
            if FRESH:
                if j0 + BLOCK_N > first_new:  # only tiles that may hold some of the step's own rows
                    new_at = ((q_start + offs_j - first_new) * stride_nt + kvh * stride_nh)[:, None] + offs_d[None, :]
                    f_mask = (j_ok & (offs_j >= first_new))[:, None] & d_ok[None, :]
                    k = tl.where(f_mask, tl.load(k_new_ptr + new_at, mask=f_mask, other=0.0).to(tl.float32), k)
                    v = tl.where(f_mask, tl.load(v_new_ptr + new_at, mask=f_mask, other=0.0).to(tl.float32), v)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, offs_j, j_ok, q_pos, row_ok, sm_scale, softcap,
                                     window, sinks, USE_WINDOW, USE_SINKS, USE_SOFTCAP, OWN_ROW)
    if OWN_ROW:
        if split == 0:  # the split merge adds the other splits' keys
            own_at = ((q_start + tok) * stride_nt + kvh * stride_nh)[:, None] + offs_d[None, :]
            own_mask = row_ok[:, None] & d_ok[None, :]
            k_own = tl.load(k_new_ptr + own_at, mask=own_mask, other=0.0).to(tl.float32)
            v_own = tl.load(v_new_ptr + own_at, mask=own_mask, other=0.0).to(tl.float32)
            m_i, l_i, acc = _attend_own(q, k_own, v_own, m_i, l_i, acc, row_ok, sm_scale, softcap, USE_SOFTCAP)

    _store_output(out_ptr, lse_ptr, acc, m_i, l_i, split, q_start, tok, head, row_ok, offs_d, d_ok,
                stride_ot, stride_oh, stride_osplit, stride_lt, stride_lsplit, NUM_SPLITS)


# --------------------------------------------------------------------------- checks
def check_attention_inputs(q, head_dim: int, kv_heads: int, block_tables, context_lens, query_start_loc) -> None:
    """q against the cache's head shape, and the batch metadata's dtypes, shapes and device."""
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise KvslimError(f"q must be [tokens, heads, {head_dim}], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise KvslimError(f"q dtype {q.dtype} is not bf16/fp16/fp32")
    if q.shape[1] % kv_heads:
        raise KvslimError(f"{q.shape[1]} query heads are not a multiple of {kv_heads} KV heads")
    check_batch(block_tables, context_lens, query_start_loc, q.device)


def check_new_rows(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                   k_scale: torch.Tensor | None) -> None:
    """The step's own rows, read exact: ``[T, KVH, D]`` in q's dtype, given together, for a quantized cache."""
    if k is None and v is None:
        return
    if k is None or v is None:
        raise KvslimError("the step's k and v must be given together")
    if k_scale is None:
        raise KvslimError("the step's own rows are read exact from a quantized cache only (this one stores them exact)")
    expected = (q.shape[0], k_cache.shape[2], k_cache.shape[3])
    for t in (k, v):
        if tuple(t.shape) != expected or t.dtype != q.dtype or t.device != q.device:
            raise KvslimError(f"the step's k/v must be {q.dtype} {list(expected)} on {q.device}, "
                              f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def check_batch(block_tables, context_lens, query_start_loc, device: torch.device) -> None:
    """The batch metadata's dtypes, shapes and device: checked once per step where it is built."""
    S = context_lens.shape[0]
    for name, t, shape in (("block_tables", block_tables, (S, block_tables.shape[-1])),
                           ("context_lens", context_lens, (S,)), ("query_start_loc", query_start_loc, (S + 1,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device:
            raise KvslimError(f"{name} must be int32 {list(shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale, v_scale) -> bool:
    check_kv_cache(k_cache, v_cache)
    per_token = check_kv_scales(k_cache, k_scale, v_scale)
    check_attention_inputs(q, k_cache.shape[3], k_cache.shape[2], block_tables, context_lens, query_start_loc)
    return per_token


def _num_splits(num_programs: int, max_q_len: int, max_context_len: int, device: torch.device) -> int:
    if max_q_len != 1 or device.type != "cuda":
        return 1
    target = torch.cuda.get_device_properties(device).multi_processor_count * 2
    by_work = max(1, max_context_len // SPLIT_MIN_TOKENS)
    return int(min(max(1, target // max(num_programs, 1)), by_work, 32))


# --------------------------------------------------------------------------- launch plan
def attention_num_warps(block_m: int, head_dim: int) -> int:
    """8 warps for prefill tiles of wide heads (4 spill registers there), else 4."""
    return 8 if block_m >= 64 and head_dim >= 128 else 4


@dataclass(frozen=True)
class LaunchPlan:
    """Tiles, grid and output buffers of one attention launch (shared by the paged kernels)."""

    block_m: int  # query tile rows: (token, head-in-group) pairs
    block_q: int  # tokens per query tile
    splits: int
    grid: tuple[int, int, int]
    out: torch.Tensor  # [T, H, D] in q's dtype, written directly when unsplit
    target: torch.Tensor  # what the kernel writes: out as [1, T, H, D], or fp32 [splits, T, H, D]
    lse: torch.Tensor  # fp32 [splits, T, H] when split (else out, unused)

    @property
    def lse_strides(self) -> tuple[int, int]:
        return (self.lse.stride(1), self.lse.stride(0)) if self.splits > 1 else (0, 0)

    def result(self) -> torch.Tensor:
        """The output, split partial softmaxes merged (one launch: ``split_merge``)."""
        if self.splits == 1:
            return self.out
        return merge_splits_into(self.lse, self.target, self.out)


def merge_splits(lse: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """The plain-torch definition of ``split_merge``'s kernel: partial outputs ``[splits, T, H, D]`` weighted by their softmax mass (base-2 log-sum-exp
    ``[splits, T, H]``), NaN-safe: a row no split saw a key for (a padded row, context 0) is zeros."""
    lse = lse * math.log(2.0)
    top = lse.amax(0, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - top)
    total = weights.sum(0, keepdim=True)
    weights = weights / torch.where(total > 0, total, torch.ones_like(total))
    return (weights.unsqueeze(-1) * partial).sum(0)


def plan_launch(q: torch.Tensor, kvh: int, num_seqs: int, max_query_len: int, max_context_len: int,
                num_splits: int | None) -> LaunchPlan:
    """Query tiles, flash-decoding splits and output buffers for ``q`` over ``num_seqs`` sequences."""
    T, H, D = q.shape
    qpk = H // kvh
    block_m = max(16, triton.next_power_of_2(qpk)) if max_query_len == 1 else max(64, triton.next_power_of_2(qpk))
    block_q = block_m // qpk
    splits = num_splits or _num_splits(num_seqs * kvh, max_query_len, max_context_len, q.device)
    out = torch.empty_like(q)
    if splits == 1:
        target, lse = out.unsqueeze(0), out
    else:
        target = torch.empty((splits, T, H, D), device=q.device, dtype=torch.float32)
        lse = torch.empty((splits, T, H), device=q.device, dtype=torch.float32)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kvh * splits)
    return LaunchPlan(block_m, block_q, splits, grid, out, target, lse)


def batch_launch_bounds(query_start_loc: torch.Tensor, context_lens: torch.Tensor, max_query_len: int | None,
                        max_context_len: int | None) -> tuple[int, int]:
    """The longest query and context of the batch, read from the device only when not given."""
    S = context_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item()) if S else 0
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if S else 0
    return max_query_len, max_context_len


# --------------------------------------------------------------------------- wrapper
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    sinks: int = 0,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    own_row_only: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of the step's tokens over their paged context (see module docstring).
    ``k``, ``v`` ``[T, KVH, D]`` (a quantized cache only): the step's new rows, already stored,
    read exact instead of from the cache (the prompt attended in full precision, as KIVI does);
    ``own_row_only``: each token reads only its own row exact, the others as stored (a decode step's view).
    ``max_query_len``/``max_context_len`` avoid a device sync when the caller knows them.
    ``validate=False``: the caller checked the cache once (``check_layer_cache``) and the batch
    where it built it (``check_batch``)."""
    if validate:
        _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale, v_scale)
        check_new_rows(q, k, v, k_cache, k_scale)
    per_token = scales_per_token(k_cache, k_scale)
    T, H, D = q.shape
    S = context_lens.shape[0]
    kvh = k_cache.shape[2]
    if T == 0 or S == 0:
        return torch.empty_like(q)
    max_query_len, max_context_len = batch_launch_bounds(query_start_loc, context_lens, max_query_len, max_context_len)
    q = q.contiguous()
    plan = plan_launch(q, kvh, S, max_query_len, max_context_len, num_splits)
    quant = k_cache.dtype not in (torch.bfloat16, torch.float16, torch.float32)
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else k_cache
    stride_sb, stride_ss = (ks.stride(0), ks.stride(1)) if per_token else (0, 0)
    target = plan.target
    stride_lt, stride_lsplit = plan.lse_strides
    fresh = k is not None
    k_new, v_new = (k.contiguous(), v.contiguous()) if fresh else (q, q)
    paged_attention_kernel[plan.grid](
        # the query and where each sequence's rows start
        q_ptr=q, stride_qt=q.stride(0), stride_qh=q.stride(1), query_start_ptr=query_start_loc,
        # the step's own new rows, read exact (a quantized cache)
        k_new_ptr=k_new, v_new_ptr=v_new, stride_nt=k_new.stride(0) if fresh else 0,
        stride_nh=k_new.stride(1) if fresh else 0,
        # the paged cache and its scales
        k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_size=k_cache.shape[1],
        stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
        k_scale_ptr=ks, v_scale_ptr=vs, stride_sb=stride_sb, stride_ss=stride_ss,
        # each sequence's blocks and context
        block_tables_ptr=block_tables, stride_bt=block_tables.stride(0), context_lens_ptr=context_lens,
        # the attention's parameters
        sm_scale=float(scale), softcap=float(softcap or 1.0), window=int(window or 0), sinks=int(sinks),
        # the output (per split, with each split's log-sum-exp)
        out_ptr=target, stride_ot=target.stride(1), stride_oh=target.stride(2), stride_osplit=target.stride(0),
        lse_ptr=plan.lse, stride_lt=stride_lt, stride_lsplit=stride_lsplit,
        # tile shapes
        QPK=H // kvh, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=32 if D <= 128 else 16, NUM_SPLITS=plan.splits,
        # modes
        KV_QUANT=quant, SCALE_PER_TOKEN=per_token, USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
        USE_SINKS=window is not None and sinks > 0, FRESH=fresh and not own_row_only, OWN_ROW=fresh and own_row_only,
        num_warps=attention_num_warps(plan.block_m, D),
    )
    return plan.result()


# --------------------------------------------------------------------------- reference (plain torch)
def gather_sequence_kv(
    cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """fp32 ``[length, KVH, D]`` rows of one sequence from a paged cache (dequantized)."""
    num_blocks = -(-length // cache.shape[1])
    return gather_blocks(cache, scale, block_table[:num_blocks].long(), torch.float32)[:length]


def attend_sequences(
    q: torch.Tensor,
    gather: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: int = 0,
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``reference_attention`` per sequence over the K, V ``[ctx, KVH, D]`` that ``gather(seq, ctx)``
    returns (the references of every paged layout); ``own``: each token's own row ``[T, KVH, D]``,
    read exact in place of the gathered one."""
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        k, v = gather(s, ctx)
        q_pos = torch.arange(ctx - (b - a), ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        rows = None if own is None else (own[0][a:b], own[1][a:b])
        out[a:b] = reference_attention(q[a:b].float(), k, v, q_pos, k_pos, scale, window, softcap, sinks,
                                       rows).to(q.dtype)
    return out


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    sinks: int = 0,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    own_row_only: bool = False,
    validate: bool = True,
) -> torch.Tensor:
    """Plain-torch oracle (and CPU path) for ``paged_attention``: per sequence, gather and
    dequantize its cache (its new rows from ``k``/``v`` where given; ``own_row_only``: each token
    only its own row), then ``attention_backend.reference_attention``. The launch bounds
    (``max_query_len``, ``max_context_len``) are the kernel's; the reference reads each sequence's own."""
    if validate:
        _check_inputs(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, k_scale, v_scale)
        check_new_rows(q, k, v, k_cache, k_scale)
    starts = query_start_loc.tolist()

    def gather(s: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        kk = gather_sequence_kv(k_cache, k_scale, block_tables[s], ctx)
        vv = gather_sequence_kv(v_cache, v_scale, block_tables[s], ctx)
        if k is not None and not own_row_only:
            a, b = starts[s], starts[s + 1]
            kk[ctx - (b - a):], vv[ctx - (b - a):] = k[a:b].float(), v[a:b].float()
        return kk, vv

    own = (k, v) if k is not None and own_row_only else None
    return attend_sequences(q, gather, context_lens, query_start_loc, scale, window, softcap, sinks, own)
