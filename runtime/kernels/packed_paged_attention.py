"""Paged attention over a packed low-bit layer (``runtime.cache.packed_layer``): decode,
prefill and extend in one kernel, as ``paged_attention`` over the same batch metadata.

The query tile, the key range, the online softmax, the flash-decoding splits and their merge
are ``paged_attention``'s. Only the reading of a K/V tile differs, as the torch path
(``runtime.attention.paged``) reads: a key written by this step (position ``>= context_len -
q_len``) comes exact from the step's own ``k``/``v``; an earlier one from its block's residual
rows when the block is open (``slot_of[block] >= 0``), else from its packed codes, unpacked and
dequantized in registers as ``minimum + code * scale`` (keys with the block's per-channel
parameters, values with their per-token ones; keys' codes ``KEY_BITS`` wide, values'
``VALUE_BITS``; 3-bit codes looked up per channel in their two planes), in fp32. A layer that
stores keys before RoPE (``ROPE``; 2- and 3-bit keys) has each cached key rotated at its position
after dequantization, in fp32: the tile's channels and their rotate-half partners (channel
``(d + D/2) % D``, the same bit offset of byte ``(p + D/2/per) % (D/per)``; 3-bit partners looked
up per channel) are both dequantized, and ``k cos +- k_partner sin`` taken.
Where key tiles lie in one block, the loop reads codes only and the open blocks come after it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundation.errors import KvslimError
from runtime.attention.key_rope import KeyRope
from runtime.cache.packed_layer import PackedLayerCache
from runtime.kernels.packed_kv_store import check_packed_layer
from runtime.kernels.paged_attention import (
    _attend_tile,
    _query_rows,
    _sink_tiles,
    _split_range,
    _store_output,
    _tile_start,
    attend_sequences,
    attention_num_warps,
    batch_launch_bounds,
    check_attention_inputs,
    plan_launch,
)


@triton.jit
def _unpack(packed, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """uint8 ``[ROWS, BLOCK_D // PER]`` -> fp32 codes ``[ROWS, BLOCK_D]``: channel
    ``p * PER + j`` is bits ``[j * BITS, (j + 1) * BITS)`` of byte p."""
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    codes = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (ROWS, BLOCK_D)).to(tl.float32)


@triton.jit
def _code_tile(codes_ptr, rows, offs_p, offs_d, rows_ok, p_ok, d_ok, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 codes ``[BLOCK_N, BLOCK_D]`` of channels ``offs_d`` (packed in bytes ``offs_p``) of the
    rows at offsets ``rows`` (0 where not ``rows_ok``). 3 bits: each channel's two bits from the
    low plane's byte ``d // 4`` and its high bit from byte ``D / 4 + d // 8``, looked up per channel."""
    if BITS == 3:
        mask = rows_ok[:, None] & d_ok[None, :]
        low = tl.load(codes_ptr + rows[:, None] + (offs_d // 4)[None, :], mask=mask, other=0).to(tl.int32)
        high_at = rows[:, None] + (HEAD_DIM // 4 + offs_d // 8)[None, :]
        high = tl.load(codes_ptr + high_at, mask=mask, other=0).to(tl.int32)
        codes = ((low >> ((offs_d % 4) * 2)[None, :]) & 3) | (((high >> (offs_d % 8)[None, :]) & 1) << 2)
        return codes.to(tl.float32)
    packed = tl.load(codes_ptr + rows[:, None] + offs_p[None, :], mask=rows_ok[:, None] & p_ok[None, :], other=0)
    return _unpack(packed, BITS, BLOCK_N, BLOCK_D)


@triton.jit
def _tile_rows(codes_ptr, residual_ptr, code_rows, res_rows, offs_p, offs_d, closed, opened, p_ok, d_ok,
               BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 codes of the closed rows and residual values of the open rows of a
    ``[BLOCK_N, BLOCK_D]`` tile (0 elsewhere); ``*_rows``: per-row offsets."""
    residual = tl.load(residual_ptr + res_rows[:, None] + offs_d[None, :], mask=opened[:, None] & d_ok[None, :], other=0.0)
    codes = _code_tile(codes_ptr, code_rows, offs_p, offs_d, closed, p_ok, d_ok, BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
    return codes, residual.to(tl.float32)


@triton.jit
def _closed_keys(k_codes_ptr, k_scale_ptr, k_min_ptr, code_base, par_base, offs_p, offs_d, cached, p_ok, d_ok,
                 BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 keys ``[BLOCK_N, BLOCK_D]`` of a tile inside one closed block, channels ``offs_d``
    (their bytes ``offs_p``), from the block's codes and per-channel parameters."""
    return (_code_tile(k_codes_ptr, code_base, offs_p, offs_d, cached, p_ok, d_ok, BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
            * tl.load(k_scale_ptr + par_base + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            + tl.load(k_min_ptr + par_base + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :])


@triton.jit
def _any_block_keys(k_codes_ptr, k_residual_ptr, k_scale_ptr, k_min_ptr, code_rows, res_rows, par_rows, offs_p,
                    offs_d, closed, opened, p_ok, d_ok, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 keys ``[BLOCK_N, BLOCK_D]``, channels ``offs_d``, of rows each looked up in its own
    block: residual rows where open, dequantized codes where closed."""
    kc, kr = _tile_rows(k_codes_ptr, k_residual_ptr, code_rows, res_rows, offs_p, offs_d, closed, opened,
                        p_ok, d_ok, BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
    k_par = par_rows[:, None] + offs_d[None, :]
    k_mask = closed[:, None] & d_ok[None, :]
    k = kc * tl.load(k_scale_ptr + k_par, mask=k_mask, other=0.0).to(tl.float32) \
        + tl.load(k_min_ptr + k_par, mask=k_mask, other=0.0).to(tl.float32)
    return tl.where(opened[:, None], kr, k)


@triton.jit
def _rotate_keys(k, k_partner, offs_j, offs_d, d_ok, inv_freq_ptr, rope_scaling, HALF: tl.constexpr):
    """Keys at positions ``offs_j`` rotated (rotate-half, as ``key_rope.apply_rotary``) in fp32."""
    inv = tl.load(inv_freq_ptr + offs_d % HALF, mask=d_ok, other=0.0)
    angle = offs_j.to(tl.float32)[:, None] * inv[None, :]
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return k * (tl.cos(angle) * rope_scaling) + k_partner * sign[None, :] * (tl.sin(angle) * rope_scaling)


@triton.jit
def _residual_tile(k_residual_ptr, v_residual_ptr, res_rows, rows, offs_j, offs_d, d_ok, inv_freq_ptr, rope_scaling,
                   HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """fp32 keys and values ``[BLOCK_N, BLOCK_D]`` of an open block's ``rows`` (0 elsewhere), read
    exact from its residual rows ``res_rows``; keys stored before RoPE rotated at ``offs_j``."""
    mask = rows[:, None] & d_ok[None, :]
    k = tl.load(k_residual_ptr + res_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        partner = (offs_d + HEAD_DIM // 2) % HEAD_DIM
        kp = tl.load(k_residual_ptr + res_rows[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        k = _rotate_keys(k, kp, offs_j, offs_d, d_ok, inv_freq_ptr, rope_scaling, HEAD_DIM // 2)
    v = tl.load(v_residual_ptr + res_rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def packed_paged_attention_kernel(
    q_ptr, k_new_ptr, v_new_ptr, k_codes_ptr, v_codes_ptr, k_scale_ptr, k_min_ptr, v_scale_ptr, v_min_ptr,
    k_residual_ptr, v_residual_ptr, slot_of_ptr,
    block_tables_ptr, context_lens_ptr, query_start_ptr, out_ptr, lse_ptr, inv_freq_ptr,
    sm_scale, softcap, window, sinks, block_size, rope_scaling,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    stride_kpb, stride_kph, stride_vpb, stride_vps,
    stride_rb, stride_rs, stride_rh, stride_bt, stride_nt, stride_nh,
    stride_ot, stride_oh, stride_osplit, stride_lt, stride_lsplit,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, QPK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, FRESH: tl.constexpr,
    USE_SINKS: tl.constexpr = False, ROPE: tl.constexpr = False,
):
    """Grid ``(S, cdiv(max_q_len, BLOCK_Q), KVH * NUM_SPLITS)``, as ``paged_attention_kernel``.
    ``TILE_IN_BLOCK`` (``block_size % BLOCK_N == 0``): key tiles start at multiples of
    BLOCK_N, so each lies in one KV block, read from its codes with one row of key parameters and
    no branch in the loop: the cached rows of an open block are skipped there and attended after
    it, from their residual rows. A sequence holds at most two blocks open (``check_open_blocks``):
    block 0 where the layer keeps its first block exact, and its last cached block. Otherwise
    every key of a tile is looked up on its own. ``FRESH``: keys at
    positions ``>= first_pos`` are read from ``k_new``/``v_new`` ``[T, KVH, D]`` (row ``q_start +
    j - first_pos``) instead of the cache; a tile may straddle ``first_pos``."""
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
                                      TILE_IN_BLOCK)

    # bytes of a packed row that tiles unpack whole (3-bit codes are looked up per channel instead)
    BLOCK_P: tl.constexpr = BLOCK_D // (8 // KEY_BITS)  # key bytes a row
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < HEAD_DIM // (8 // KEY_BITS)
    BLOCK_VP: tl.constexpr = BLOCK_D // (8 // VALUE_BITS)  # value bytes a row
    offs_vp = tl.arange(0, BLOCK_VP)
    vp_ok = offs_vp < HEAD_DIM // (8 // VALUE_BITS)
    HALF: tl.constexpr = HEAD_DIM // 2
    if ROPE:  # rotate-half partners: channel (d + D/2) % D, in byte (p + D/2/per) % (D/per); 3 bits: by channel
        offs_dr = (offs_d + HALF) % HEAD_DIM
        offs_pr = (offs_p + HALF // (8 // KEY_BITS)) % (HEAD_DIM // (8 // KEY_BITS))
    first_pos = ctx - q_len
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    sink_tiles, sink_end = _sink_tiles(split, split_lo, sinks, BLOCK_N, USE_SINKS)
    for t in range(0, sink_tiles + tl.cdiv(split_hi - split_lo, BLOCK_N)):
        j0, j_end = _tile_start(t, sink_tiles, sink_end, split_lo, split_hi, BLOCK_N)
        offs_j = j0 + tl.arange(0, BLOCK_N)
        j_ok = offs_j < j_end
        if FRESH:
            cached = j_ok & (offs_j < first_pos)
        else:
            cached = j_ok
        off = offs_j % block_size
        if TILE_IN_BLOCK:  # the tile's cached rows from codes; an open block's are read after the loop
            blk = tl.load(block_tables_ptr + seq * stride_bt + j0 // block_size).to(tl.int64)
            closed = cached & (tl.load(slot_of_ptr + blk) + tl.zeros_like(offs_j) < 0)
            attend_ok = j_ok & (closed | ~cached)
            code_base = blk * stride_cb + off * stride_cs + kvh * stride_ch
            par_base = blk * stride_kpb + kvh * stride_kph
            k = _closed_keys(k_codes_ptr, k_scale_ptr, k_min_ptr, code_base, par_base, offs_p, offs_d, closed,
                             p_ok, d_ok, KEY_BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
            if ROPE:
                kp = _closed_keys(k_codes_ptr, k_scale_ptr, k_min_ptr, code_base, par_base, offs_pr, offs_dr,
                                  closed, p_ok, d_ok, KEY_BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
                k = _rotate_keys(k, kp, offs_j, offs_d, d_ok, inv_freq_ptr, rope_scaling, HALF)
            v_par = blk * stride_vpb + off * stride_vps + kvh
            v_code_base = blk * stride_vcb + off * stride_vcs + kvh * stride_vch
            v = (_code_tile(v_codes_ptr, v_code_base, offs_vp, offs_d, closed, vp_ok, d_ok, VALUE_BITS, BLOCK_N,
                            BLOCK_D, HEAD_DIM)
                 * tl.load(v_scale_ptr + v_par, mask=closed, other=0.0).to(tl.float32)[:, None]
                 + tl.load(v_min_ptr + v_par, mask=closed, other=0.0).to(tl.float32)[:, None])
        else:
            blk = tl.load(block_tables_ptr + seq * stride_bt + offs_j // block_size, mask=cached, other=0).to(tl.int64)
            rslot = tl.load(slot_of_ptr + blk, mask=cached, other=-1)
            opened = cached & (rslot >= 0)
            closed = cached & (rslot < 0)
            code_rows = blk * stride_cb + off * stride_cs + kvh * stride_ch
            v_code_rows = blk * stride_vcb + off * stride_vcs + kvh * stride_vch
            res_rows = rslot * stride_rb + off * stride_rs + kvh * stride_rh
            par_rows = blk * stride_kpb + kvh * stride_kph
            vc, vr = _tile_rows(v_codes_ptr, v_residual_ptr, v_code_rows, res_rows, offs_vp, offs_d, closed, opened,
                                vp_ok, d_ok, VALUE_BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
            k = _any_block_keys(k_codes_ptr, k_residual_ptr, k_scale_ptr, k_min_ptr, code_rows, res_rows, par_rows,
                                offs_p, offs_d, closed, opened, p_ok, d_ok, KEY_BITS, BLOCK_N, BLOCK_D, HEAD_DIM)
            if ROPE:
                kp = _any_block_keys(k_codes_ptr, k_residual_ptr, k_scale_ptr, k_min_ptr, code_rows, res_rows,
                                     par_rows, offs_pr, offs_dr, closed, opened, p_ok, d_ok, KEY_BITS, BLOCK_N,
                                     BLOCK_D, HEAD_DIM)
                k = _rotate_keys(k, kp, offs_j, offs_d, d_ok, inv_freq_ptr, rope_scaling, HALF)
            v_par = blk * stride_vpb + off * stride_vps + kvh
            v = vc * tl.load(v_scale_ptr + v_par, mask=closed, other=0.0).to(tl.float32)[:, None] \
                + tl.load(v_min_ptr + v_par, mask=closed, other=0.0).to(tl.float32)[:, None]
            v = tl.where(opened[:, None], vr, v)
            attend_ok = j_ok
        # The tile in q's dtype, as the dots read it, so that a fresh row is a masked load over it.
        k = k.to(q_ptr.dtype.element_ty)
        v = v.to(q_ptr.dtype.element_ty)
        if FRESH:
            fresh = j_ok & (offs_j >= first_pos)
            new_at = ((q_start + offs_j - first_pos) * stride_nt + kvh * stride_nh)[:, None] + offs_d[None, :]
            f_mask = fresh[:, None] & d_ok[None, :]
            k = tl.load(k_new_ptr + new_at, mask=f_mask, other=k)
            v = tl.load(v_new_ptr + new_at, mask=f_mask, other=v)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, offs_j, attend_ok, q_pos, row_ok, sm_scale, softcap,
                                     window, sinks, USE_WINDOW, USE_SINKS, USE_SOFTCAP)

    if TILE_IN_BLOCK:  # the open blocks' cached rows: block 0 (an exact first block), the last cached block
        cached_end = ctx
        if FRESH:
            cached_end = first_pos
        last = tl.maximum(cached_end - 1, 0) // block_size
        for i in range(0, 1 + (last > 0).to(tl.int32)):
            b = i * last
            # a block a window released is -1 here, or 0 from a batch: `rows` and the window leave it unread
            blk = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
            rslot = tl.load(slot_of_ptr + tl.maximum(blk, 0))
            lo = b * block_size
            in_range = ((lo < split_hi) & (lo + block_size > split_lo)) | (lo < sink_end)  # this program's keys
            if (blk >= 0) & (rslot >= 0) & (cached_end > 0) & in_range:
                for t in range(0, block_size // BLOCK_N):
                    offs_j = b * block_size + t * BLOCK_N + tl.arange(0, BLOCK_N)
                    rows = (offs_j < cached_end) & (((offs_j >= split_lo) & (offs_j < split_hi)) | (offs_j < sink_end))
                    k, v = _residual_tile(k_residual_ptr, v_residual_ptr, rslot * stride_rb
                                          + (offs_j % block_size) * stride_rs + kvh * stride_rh, rows, offs_j, offs_d,
                                          d_ok, inv_freq_ptr, rope_scaling, HEAD_DIM, ROPE)
                    m_i, l_i, acc = _attend_tile(q, k.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty),
                                                 m_i, l_i, acc, offs_j, rows, q_pos, row_ok, sm_scale, softcap, window,
                                                 sinks, USE_WINDOW, USE_SINKS, USE_SOFTCAP)

    _store_output(out_ptr, lse_ptr, acc, m_i, l_i, split, q_start, tok, head, row_ok, offs_d, d_ok,
                  stride_ot, stride_oh, stride_osplit, stride_lt, stride_lsplit, NUM_SPLITS)


def key_tile(block_size: int, head_dim: int) -> tuple[int, bool]:
    """Keys per tile (BLOCK_N) and whether every tile lies in one KV block: 32 (16 for head_dim
    over 128) where the block size allows, else 16 keys looked up one by one (more spill)."""
    for n in (32, 16) if head_dim <= 128 else (16,):
        if block_size % n == 0:
            return n, True
    return 16, False


def check_packed_rope(cache: PackedLayerCache, key_rope: KeyRope | None) -> None:
    """A key rope the kernel can apply on read to this layer's packed keys (None: keys stored rotated)."""
    d = cache.k_residual.shape[-1]
    bits = cache.bits.keys
    multiple = 8 if bits == 3 else 2 * (8 // bits)  # whole bytes a half (3 bits: whole bytes a plane)
    if key_rope is not None and (len(key_rope.inv_freq) * 2 != d or d % multiple):
        raise KvslimError(f"a key rope of {len(key_rope.inv_freq)} frequencies cannot rotate {bits}-bit "
                          f"keys of head_dim {d} (needs head_dim / 2 frequencies, head_dim a multiple of "
                          f"{multiple})")


def check_open_blocks(cache: PackedLayerCache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, fresh: bool, window: int | None = None, sinks: int = 0) -> None:
    """Between its first and its last cached block no sequence holds an open block that it reads:
    the kernel's key tiles read the open rows of those two only (a sync: ``validate`` mode). With a
    ``window``, blocks wholly before the earliest query's window (past the sinks) are not read: a
    window may have released them, and the batch points such entries at block 0."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    cached_blocks = -(-(context_lens - q_lens if fresh else context_lens) // cache.block_size)
    b = torch.arange(block_tables.shape[1], device=block_tables.device)
    between = (b[None, :] > 0) & (b[None, :] < cached_blocks[:, None] - 1)
    if window is not None:
        live_from = (context_lens - q_lens - window + 1).clamp(min=0)
        read = ((b[None, :] + 1) * cache.block_size > live_from[:, None]) | (b[None, :] * cache.block_size < sinks)
        between &= read
    opened = (block_tables >= 0) & (cache.slot_of[block_tables.long().clamp(min=0)] >= 0)
    bad = (between & opened).nonzero()
    if len(bad):
        s, i = bad[0].tolist()
        raise KvslimError(f"sequence {s}'s block {i} is open (it holds a residual slot) between its first and "
                          f"last cached blocks; the packed attention kernel reads open rows of those two only")


def _check_inputs(q, k, v, cache: PackedLayerCache, block_tables, context_lens, query_start_loc,
                  key_rope: KeyRope | None) -> None:
    check_packed_layer(cache)
    check_packed_rope(cache, key_rope)
    _, _, kvh, d = cache.k_residual.shape
    check_attention_inputs(q, d, kvh, block_tables, context_lens, query_start_loc)
    if (k is None) != (v is None):
        raise KvslimError("the step's k and v must be given together")
    expected = (q.shape[0], kvh, d)
    for t in () if k is None else (k, v):
        if tuple(t.shape) != expected or t.dtype != q.dtype or t.device != q.device:
            raise KvslimError(f"the step's k/v must be {q.dtype} {list(expected)} on {q.device}, "
                              f"got {t.dtype} {tuple(t.shape)} on {t.device}")


# --------------------------------------------------------------------------- wrapper
def packed_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache: PackedLayerCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    sinks: int = 0,
    key_rope: KeyRope | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of the step's tokens over their paged context in a packed layer (the
    batch metadata and its meaning are ``paged_attention``'s). ``k``, ``v`` ``[T, KVH, D]`` in q's
    dtype: the step's new rows (rotated), already stored, read exact; None (a layer reading
    another's KV): every key is read from the cache. ``key_rope``: the cache holds keys before
    RoPE, rotated by it at each key's position after dequantization. ``validate=False``: the
    caller checked the layer once (``check_packed_layer``, ``check_packed_rope``) and the batch
    where it built it (``check_batch``)."""
    if validate:
        _check_inputs(q, k, v, cache, block_tables, context_lens, query_start_loc, key_rope)
    T, H, D = q.shape
    S = context_lens.shape[0]
    if T == 0 or S == 0:
        return torch.empty_like(q)
    max_query_len, max_context_len = batch_launch_bounds(query_start_loc, context_lens, max_query_len, max_context_len)
    res, codes, vc, ks, vs = cache.k_residual, cache.k_codes, cache.v_codes, cache.k_scale, cache.v_scale
    kvh = res.shape[2]
    q = q.contiguous()
    fresh = k is not None
    k_new, v_new = (k.contiguous(), v.contiguous()) if fresh else (q, q)
    plan = plan_launch(q, kvh, S, max_query_len, max_context_len, num_splits)
    target = plan.target
    block_n, in_block = key_tile(res.shape[1], D)
    if validate and in_block:
        check_open_blocks(cache, block_tables, context_lens, query_start_loc, fresh, window, sinks)
    inv_freq = key_rope.inv_freq_on(q.device) if key_rope is not None else cache.slot_of
    stride_lt, stride_lsplit = plan.lse_strides
    packed_paged_attention_kernel[plan.grid](
        # the query, where each sequence's rows start, and the step's own new rows (read exact)
        q_ptr=q, stride_qt=q.stride(0), stride_qh=q.stride(1), query_start_ptr=query_start_loc,
        k_new_ptr=k_new, v_new_ptr=v_new, stride_nt=k_new.stride(0) if fresh else 0,
        stride_nh=k_new.stride(1) if fresh else 0,
        # the packed cache: codes, their parameters, the open blocks' residual rows and slots
        k_codes_ptr=codes, v_codes_ptr=vc, block_size=res.shape[1],
        stride_cb=codes.stride(0), stride_cs=codes.stride(1), stride_ch=codes.stride(2),
        stride_vcb=vc.stride(0), stride_vcs=vc.stride(1), stride_vch=vc.stride(2),
        k_scale_ptr=ks, k_min_ptr=cache.k_min, stride_kpb=ks.stride(0), stride_kph=ks.stride(1),
        v_scale_ptr=vs, v_min_ptr=cache.v_min, stride_vpb=vs.stride(0), stride_vps=vs.stride(1),
        k_residual_ptr=res, v_residual_ptr=cache.v_residual, slot_of_ptr=cache.slot_of,
        stride_rb=res.stride(0), stride_rs=res.stride(1), stride_rh=res.stride(2),
        # each sequence's blocks and context
        block_tables_ptr=block_tables, stride_bt=block_tables.stride(0), context_lens_ptr=context_lens,
        # the attention's parameters, and the rotation of keys stored before RoPE
        sm_scale=float(scale), softcap=float(softcap or 1.0), window=int(window or 0), sinks=int(sinks),
        inv_freq_ptr=inv_freq, rope_scaling=float(key_rope.scaling) if key_rope is not None else 1.0,
        # the output (per split, with each split's log-sum-exp)
        out_ptr=target, stride_ot=target.stride(1), stride_oh=target.stride(2), stride_osplit=target.stride(0),
        lse_ptr=plan.lse, stride_lt=stride_lt, stride_lsplit=stride_lsplit,
        # tile shapes
        KEY_BITS=cache.bits.keys, VALUE_BITS=cache.bits.values, QPK=H // kvh, HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q, BLOCK_N=block_n, NUM_SPLITS=plan.splits,
        # modes
        TILE_IN_BLOCK=in_block, USE_WINDOW=window is not None, USE_SOFTCAP=softcap is not None,
        FRESH=fresh, USE_SINKS=window is not None and sinks > 0, ROPE=key_rope is not None,
        num_warps=attention_num_warps(plan.block_m, D),
    )
    return plan.result()


# --------------------------------------------------------------------------- reference (plain torch)
def reference_packed_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache: PackedLayerCache,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    sinks: int = 0,
    key_rope: KeyRope | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Plain-torch oracle (and CPU path) for ``packed_paged_attention`` (launch bounds ignored), the
    torch path's read: per sequence, ``PackedLayerCache.gather`` in fp32 (keys rotated by ``key_rope`` at their
    positions), the step's own rows overwritten with ``k``/``v``, then ``reference_attention``."""
    if validate:
        _check_inputs(q, k, v, cache, block_tables, context_lens, query_start_loc, key_rope)
    bs = cache.block_size
    starts = query_start_loc.tolist()

    def gather(s: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        kk, vv = cache.gather(block_tables[s, : -(-ctx // bs)].long(), torch.float32)
        kk, vv = kk[:ctx], vv[:ctx]
        if key_rope is not None:
            kk = key_rope.rotate(kk, torch.arange(ctx, device=kk.device))
        if k is not None:
            rows = slice(starts[s], starts[s + 1])
            first = ctx - (rows.stop - rows.start)
            kk[first:], vv[first:] = k[rows], v[rows]
        return kk, vv

    return attend_sequences(q, gather, context_lens, query_start_loc, scale, window, softcap, sinks)
