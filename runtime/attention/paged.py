"""``AttentionBackend`` over the paged KV cache, in plain torch (the CPU path).

The engine builds a ``PagedBatch`` per step (from the scheduler's output and the block tables)
and hands it to the backend with ``set_batch``; the decoder then calls ``attend`` per layer.
Sequences decoding one token are attended together (their blocks gathered into one padded
batch); sequences with several new tokens (prefill chunks) one at a time, over their cached
prefix plus the chunk. Quantized caches are dequantized on read to q's dtype; SDPA does the
math (fp32 accumulation); logit softcap takes a plain fp32 path. With a quantized cache a step
reads its own new rows exact (KIVI: the prompt is attended in full precision) and everything
written before as stored: FP8/INT8 rows quantized; with int4/int2 earlier blocks quantized, the
sequence's open block exact. ``Engine.score`` has FP8/INT8 read a piece's rows as a decode step
would (``PagedBatch.exact_new_rows`` False): each scored token its own row exact, every other row
as stored. Keys arrive before rotary (``AttentionParams.key_rope``): rotated here before the write,
or, in a layout that stores them before RoPE (int2, k3v2), after it, and every key read rotated at
its position in fp32. A layer with 2-bit values (int2, k4v2, k3v2) keeps them in a rotated basis
(``kv_rotation``): they rotate on their way in and the layer's output rotates back; one with 4-bit
keys (int4, k4v2) keeps its keys, after RoPE, in a rotated basis and rotates the queries alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from runtime.attention.backend import AttentionParams
from runtime.attention.key_rope import KeyRope, StepKeyRotary
from runtime.cache.kv_cache import RELEASED, KVCache, sink_block_count
from runtime.cache.write_plan import WritePlan
from runtime.transfer import to_device_at_once


@dataclass(frozen=True)
class PagedBatch:
    """One step's attention metadata (the layout shared with ``runtime/kernels``).

    ``block_tables[g]`` int32 ``[num_seqs, max_blocks]`` (released / unused entries are 0 and
    never read), ``context_lens`` int32 ``[num_seqs]`` (tokens in the cache after this step),
    ``slot_mapping[g]`` int64 ``[T]`` (block * block_size + offset of each new token),
    ``query_start_loc`` int32 ``[num_seqs + 1]``, ``positions`` int64 ``[T]``.
    """

    block_size: int
    query_lens: tuple[int, ...]
    first_positions: tuple[int, ...]
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    block_tables: tuple[torch.Tensor, ...]
    slot_mapping: tuple[torch.Tensor, ...]
    decode_seqs: torch.Tensor  # indices of sequences with exactly one new token
    decode_rows: torch.Tensor  # their rows in the flattened batch
    slot_mapping_host: tuple[torch.Tensor, ...] = ()  # ``slot_mapping`` as built on the host
    positions_host: torch.Tensor | None = None  # ``positions`` as built on the host
    # per int4/int2 group, the step's writes already planned and applied (a CUDA graph's per-row
    # plans, ``WritePlan.per_row_plan``); None: the backend's ``set_batch`` plans them
    write_plans: Mapping[int, WritePlan] | None = None
    # FP8/INT8 layers read the step's new rows exact (False: each token only its own row exact and
    # the others as stored, as a decode step reads them: ``Engine.score``; int4/int2 read every new
    # row exact either way)
    exact_new_rows: bool = True

    def packed_writes(self, cache: KVCache) -> dict[int, WritePlan]:
        """The step's packed writes by cache group, planned and applied once per step."""
        if self.write_plans is not None:
            return dict(self.write_plans)
        return cache.plan_packed_writes(self.write_plan)

    def write_plan(self, g: int, exact_first_block: bool = False) -> WritePlan:
        """Group ``g``'s packed-KV write plan for this step, from the host's slots (no device read);
        ``exact_first_block``: the group keeps each sequence's first block in its residual slot.
        The backend's ``set_batch`` asks once per group (``KVCache.plan_packed_writes``)."""
        slots = self.slot_mapping_host[g] if self.slot_mapping_host else self.slot_mapping[g]
        positions = self.positions_host if self.positions_host is not None else self.positions
        return WritePlan.of(slots, self.block_size, self.slot_mapping[g].device, positions, exact_first_block)

    @classmethod
    def build(
        cls,
        block_size: int,
        first_positions: Sequence[int],
        query_lens: Sequence[int],
        tables: Sequence[Sequence[Sequence[int]]],  # per sequence, per group: block table
        device: torch.device | str = "cpu",
        exact_new_rows: bool = True,
    ) -> "PagedBatch":
        num_groups = len(tables[0]) if tables else 0
        host = torch.device("cpu")  # built on the host, copied to ``device`` once
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(p, p + n, device=host) for p, n in zip(first_positions, query_lens)])
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=host),
                                               torch.tensor(query_lens, device=host))
        block_tables, slot_mapping = [], []
        for g in range(num_groups):
            width = max(len(t[g]) for t in tables)
            bt = torch.zeros(len(tables), width, dtype=torch.int32, device=host)
            for i, t in enumerate(tables):
                row = torch.tensor(t[g], dtype=torch.int32, device=host)
                bt[i, : len(row)] = row.clamp_min(0) if RELEASED in t[g] else row
            block_tables.append(bt)
            slot_mapping.append(bt[seq_of_token, positions // block_size].long() * block_size + positions % block_size)
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        on_host = [positions, torch.tensor(starts, dtype=torch.int32, device=host),
                   torch.tensor([p + n for p, n in zip(first_positions, query_lens)], dtype=torch.int32, device=host),
                   torch.tensor(decode, dtype=torch.long, device=host),
                   torch.tensor([starts[i] for i in decode], dtype=torch.long, device=host),
                   *block_tables, *slot_mapping]
        dev = to_device_at_once(on_host, torch.device(device))  # one copy to a GPU
        return cls(
            block_size=block_size,
            query_lens=tuple(query_lens),
            first_positions=tuple(first_positions),
            positions=dev[0],
            query_start_loc=dev[1],
            context_lens=dev[2],
            block_tables=tuple(dev[5:5 + num_groups]),
            slot_mapping=tuple(dev[5 + num_groups:]),
            decode_seqs=dev[3],
            decode_rows=dev[4],
            slot_mapping_host=tuple(slot_mapping),
            positions_host=positions,
            exact_new_rows=exact_new_rows,
        )


def _attend(
    q: torch.Tensor,  # [S, Tq, H, D]
    k: torch.Tensor,  # [S, Tk, KVH, D] (dequantized to q's dtype)
    v: torch.Tensor,
    allowed: torch.Tensor,  # [S, Tq, Tk] bool; every query row allows at least its own key
    params: AttentionParams,
) -> torch.Tensor:
    s, tq, h, d = q.shape
    kvh = k.shape[2]
    if params.softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed.unsqueeze(1),
            scale=params.scale, enable_gqa=h != kvh,
        )  # [S, H, Tq, D]
        return out.transpose(1, 2)
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()  # the softcap path in fp32, as reference_attention
    qh = q.view(s, tq, kvh, h // kvh, d).permute(0, 2, 3, 1, 4)  # [S, KVH, rep, Tq, D]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [S, KVH, 1, D, Tk]
    scores = torch.matmul(qh, kt) * params.scale  # [S, KVH, rep, Tq, Tk]
    scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2))  # [S, KVH, rep, Tq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(s, tq, h, d).to(dtype)


def _with_own_rows(kk: torch.Tensor, vv: torch.Tensor, allowed: torch.Tensor, k_own: torch.Tensor,
                   v_own: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V and mask for ``_attend`` so that each query token reads its own row exact and every other
    row as stored (what a decode step of it reads): the exact rows ``[Tq, KVH, D]`` appended as Tq
    more keys, query t allowed only the t-th of them, and its stored own row (key ``at + t``) masked."""
    n = k_own.shape[0]
    rows = torch.arange(n, device=allowed.device)
    mask = allowed.clone()
    mask[:, rows, at + rows] = False
    eye = torch.eye(n, dtype=torch.bool, device=allowed.device).unsqueeze(0)
    k2 = torch.cat([kk, k_own.unsqueeze(0).to(kk.dtype)], dim=1)
    v2 = torch.cat([vv, v_own.unsqueeze(0).to(vv.dtype)], dim=1)
    return k2, v2, torch.cat([mask, eye], dim=2)


@dataclass(frozen=True)
class _ReadPlan:
    """Which cached blocks a step reads for one (group, window), and the attention mask.
    The same for every layer of the group, so computed once per step."""

    decode_blocks: torch.Tensor | None  # [S_decode, nb] physical block ids
    # One of these two masks, by the decode path that reads it: a boolean [S_decode, 1, Tk] for the
    # softcap path, an additive [S_decode, 1, 1, Tk] (0 / -inf, q's dtype) for SDPA.
    decode_allowed: torch.Tensor | None
    decode_bias: torch.Tensor | None
    decode_new_key: torch.Tensor | None  # [S_decode]: each new token's own key among the Tk read
    decode_key_pos: torch.Tensor | None  # [S_decode, Tk]: the position of each key read
    # (seq, rows, blocks [1, nb], allowed [1, n, Tk], index of the chunk's first key among those
    # read, key positions [1, Tk])
    chunks: tuple[tuple[int, slice, torch.Tensor, torch.Tensor, int, torch.Tensor], ...]


def _plan(batch: PagedBatch, table: torch.Tensor, window: int | None, sinks: int, dtype: torch.dtype,
          softcap: bool) -> _ReadPlan:
    """Blocks read: all of them (full attention), or the window's blocks after the blocks
    holding the ``sinks`` first positions (each block read once)."""
    bs = batch.block_size
    dev = table.device  # every index built here lives where the block tables do
    sink_blocks = sink_block_count(sinks, bs) if window is not None else 0
    decode_blocks = decode_allowed = decode_bias = decode_new_key = decode_key_pos = None
    if batch.decode_seqs.numel():
        idx = batch.decode_seqs
        ctx = batch.context_lens[idx].long()  # [S]
        if window is None:
            cols = torch.arange(-(-int(ctx.max()) // bs), device=dev).expand(len(idx), -1)
        else:
            lo = (ctx - window).clamp_min(0).div(bs, rounding_mode="floor").clamp_min(sink_blocks)
            # The window's blocks, but no more than the longest sequence has past its window's
            # first block: a short context reads its few blocks, not a whole window of masked ones.
            needed = int(((ctx + bs - 1) // bs - lo).max())
            n = max(1, min(-(-(window + bs - 1) // bs), needed))
            sink_cols = torch.arange(sink_blocks, device=dev).expand(len(idx), -1)
            cols = torch.cat([sink_cols, lo[:, None] + torch.arange(n, device=dev)], dim=1)
        # Columns past a table's end read block 0; their key positions are >= ctx, so masked.
        decode_blocks = table[idx[:, None], cols.clamp_max(table.shape[1] - 1)]
        key_pos = decode_key_pos = (cols[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)  # [S, Tk]
        # The new token's key: in a sink block at its own position, else offset from the window's first column.
        last = ctx - 1
        in_sinks = last < sink_blocks * bs
        decode_new_key = torch.where(in_sinks, last, last - (cols[:, sink_blocks] - sink_blocks) * bs) if window is not None \
            else last - cols[:, 0] * bs
        allowed = key_pos < ctx[:, None]
        if window is not None:
            allowed &= (key_pos >= (ctx - window)[:, None]) | (key_pos < sinks)
        if softcap:
            decode_allowed = allowed.unsqueeze(1)
        else:
            decode_bias = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, float("-inf"))
            decode_bias = decode_bias[:, None, None]
    chunks = []
    starts = batch.query_start_loc.tolist()
    for i, n in enumerate(batch.query_lens):
        if n == 1:
            continue
        first = batch.first_positions[i]
        ctx = first + n
        lo = 0 if window is None else max(0, first - window + 1) // bs
        cols = torch.cat([torch.arange(min(sink_blocks, lo), device=dev), torch.arange(lo, -(-ctx // bs), device=dev)])
        key_pos = (cols[:, None] * bs + torch.arange(bs, device=dev)).flatten()
        dist = torch.arange(first, ctx, device=dev)[:, None] - key_pos[None, :]
        allowed = dist >= 0
        if window is not None:
            allowed &= (dist < window) | (key_pos < sinks)[None, :]
        chunks.append((i, slice(starts[i], starts[i] + n), table[i, cols].unsqueeze(0), allowed.unsqueeze(0),
                       (min(sink_blocks, lo) - lo) * bs + first, key_pos.unsqueeze(0)))
    return _ReadPlan(decode_blocks, decode_allowed, decode_bias, decode_new_key, decode_key_pos, tuple(chunks))


def _attend_decode(
    q: torch.Tensor,  # [S, H, D]: one new token per sequence
    k: torch.Tensor,  # [S, Tk, KVH, D]
    v: torch.Tensor,
    plan: _ReadPlan,
    params: AttentionParams,
) -> torch.Tensor:
    """Decode attention with the query heads of each KV head laid out as that head's query rows
    (``[S, KVH, H / KVH, D]``): one query token, so every row shares the mask, and SDPA attends
    each KV head once instead of expanding K/V to every query head (2x faster measured)."""
    if params.softcap is not None:
        return _attend(q.unsqueeze(1), k, v, plan.decode_allowed, params).squeeze(1)
    s, h, d = q.shape
    kvh = k.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(s, kvh, h // kvh, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.decode_bias,
        scale=params.scale,
    )  # [S, KVH, H / KVH, D]
    return out.reshape(s, h, d)


class PagedAttentionBackend:
    """Writes new K/V into the paged cache and attends over it (torch reference path)."""

    def __init__(self, cache: KVCache, params: Sequence[AttentionParams]):
        self.cache = cache
        self.params = tuple(params)
        self.batch: PagedBatch | None = None
        self._write_plans: dict[int, WritePlan] = {}  # the step's packed writes, by cache group
        self._plans: dict[tuple[int, int | None, int, torch.dtype, bool], _ReadPlan] = {}
        # int4/int2: each cache slot's new rows this step, for the layers that read that slot's KV
        self._new_rows_by_slot: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._rotary: StepKeyRotary | None = None

    def set_batch(self, batch: PagedBatch) -> None:
        self.batch = batch
        self._plans = {}
        self._write_plans = batch.packed_writes(self.cache)  # int4/int2 groups: once per step
        self._new_rows_by_slot = {}
        self._rotary = StepKeyRotary(batch.positions)

    def _read(self, layer_idx: int, blocks: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype,
              rope: KeyRope | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``blocks`` in ``dtype``; keys stored before RoPE rotated at ``key_pos`` in fp32."""
        if rope is None:
            return self.cache.gather(layer_idx, blocks, dtype)
        kk, vv = self.cache.layers[layer_idx].gather(blocks, dtype, key_dtype=torch.float32)  # a packed layer
        return rope.rotate(kk, key_pos, dtype), vv

    def share_rotary(self, tables: dict) -> None:
        """The decoder's cos/sin of this step by (rope, dtype): the keys rotate by them too."""
        self._rotary.share(tables)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        rotation = self.cache.value_rotation(layer_idx)
        if rotation is None:
            return self._attend_layer(layer_idx, q, k, v)
        return rotation.restore(self._attend_layer(layer_idx, q, k, None if v is None else rotation.rotate(v)))

    def _attend_layer(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None,
                      v: torch.Tensor | None) -> torch.Tensor:
        """``attend`` with values in the basis of the layer's cache."""
        batch = self.batch
        assert batch is not None, "set_batch() before attend()"
        slot = self.cache.spec.layer_slots[layer_idx]
        g = slot[0]
        params = self.params[layer_idx]
        rope = self.params[params.kv_source].key_rope  # the keys' rotation is their owner's
        read_rope = rope if self.cache.keys_before_rope(layer_idx) else None  # rotate keys on read
        packed = self.cache.is_packed(layer_idx)
        key_basis = self.cache.key_rotation(layer_idx)  # keys after RoPE and queries rotated alike
        if key_basis is not None:
            q = key_basis.rotate(q)
        if k is not None:
            k_rotated = self._rotary(rope, k)
            if key_basis is not None:
                k_rotated = key_basis.rotate(k_rotated)
            plan = self._write_plans[g] if packed else None
            self.cache.write(layer_idx, k if read_rope else k_rotated, v, batch.slot_mapping[g], plan)
            k = k_rotated
        quantized = self.cache.is_quantized(layer_idx)
        own_rows_exact = packed or (batch.exact_new_rows and quantized)  # every new row exact
        own_row_only = quantized and not own_rows_exact  # each token its own row exact, as decoded
        if quantized and k is not None:
            self._new_rows_by_slot[slot] = (k, v)
        elif quantized:  # a layer reading another layer's KV reads its new rows exact too
            k, v = self._new_rows_by_slot.get(slot, (None, None))
        softcap = params.softcap is not None
        key = (g, params.window, params.sinks, q.dtype, softcap)
        if key not in self._plans:
            self._plans[key] = _plan(batch, batch.block_tables[g], params.window, params.sinks, q.dtype, softcap)
        plan = self._plans[key]
        overlay_new_rows = k is not None and own_rows_exact  # read this step's rows exact
        overlay_own_row = k is not None and quantized  # a decoding token's one new row is its own
        if plan.decode_blocks is not None and not plan.chunks:  # a pure decode step
            kk, vv = self._read(layer_idx, plan.decode_blocks, plan.decode_key_pos, q.dtype, read_rope)
            if overlay_own_row:
                _put_decode_rows(kk, vv, k, v, plan.decode_new_key)
            return _attend_decode(q, kk, vv, plan, params)
        out = torch.empty_like(q)
        if plan.decode_blocks is not None:
            rows = batch.decode_rows
            kk, vv = self._read(layer_idx, plan.decode_blocks, plan.decode_key_pos, q.dtype, read_rope)
            if overlay_own_row:
                _put_decode_rows(kk, vv, k[rows], v[rows], plan.decode_new_key)
            out[rows] = _attend_decode(q[rows], kk, vv, plan, params)
        new_rows_cached_exactly = k is not None and (overlay_new_rows
                                                     or self.cache.stores_exactly(layer_idx, q.dtype))
        for i, rows, blocks, allowed, fresh_at, key_pos in plan.chunks:
            n = rows.stop - rows.start
            whole_prompt = batch.first_positions[i] == 0 and (params.window or n) >= n
            if new_rows_cached_exactly and whole_prompt and params.softcap is None:
                # A whole prompt in one chunk: its keys are exactly this step's k/v.
                # 4-D inputs: CPU SDPA takes its flash kernel only for those (3-D runs the math path).
                out[rows] = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                    is_causal=True, scale=params.scale, enable_gqa=q.shape[1] != k.shape[1],
                )[0].transpose(0, 1)
                continue
            kk, vv = self._read(layer_idx, blocks, key_pos, q.dtype, read_rope)
            if overlay_new_rows:
                kk[0, fresh_at:fresh_at + n], vv[0, fresh_at:fresh_at + n] = k[rows], v[rows]
            elif own_row_only and k is not None:
                kk, vv, allowed = _with_own_rows(kk, vv, allowed, k[rows], v[rows], fresh_at)
            out[rows] = _attend(q[rows].unsqueeze(0), kk, vv, allowed, params).squeeze(0)
        return out


def _put_decode_rows(kk: torch.Tensor, vv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor) -> None:
    """Overwrite each decoding sequence's own new key/value (read back from the cache) with the exact one."""
    seqs = torch.arange(kk.shape[0], device=kk.device)
    kk[seqs, at], vv[seqs, at] = k.to(kk.dtype), v.to(vv.dtype)
