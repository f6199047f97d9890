"""The Triton store and paged attention of packed int4/int2/k4v2/k3v2 KV against the torch path
(``PackedLayerCache.write`` / ``gather`` and ``reference_attention``). On CPU the kernels run in
the interpreter, in fp32 (fp32 queries and residual)."""
from dataclasses import replace
from unittest import mock

import pytest
import torch

from foundation.errors import KvslimError
from runtime.attention.backend import reference_attention
from runtime.attention.key_rope import KeyRope
from runtime.cache.low_bit_kv import quantize_key_blocks, unpack
from runtime.cache.write_plan import WritePlan
from runtime.kernels import packed_kv_store as pks
from runtime.kernels import packed_paged_attention as ppa
from runtime.model.spec import RopeSpec
from tests.runtime.conftest import requires_gpu
from tests.runtime.kernels.packed_setup import make_packed_batch, packed_layer

TENSORS = ("k_codes", "v_codes", "k_scale", "k_min", "v_scale", "v_min", "k_residual", "v_residual", "slot_of")


def assert_same_layer(ours, theirs) -> None:
    """Bit for bit, codes included: the kernel divides with IEEE ``div_rn`` and rounds half to
    even, as ``torch.round``, from the same fp16 parameters, so not even an exact rounding tie
    may land on another code."""
    for name in TENSORS:
        assert torch.equal(getattr(ours, name).cpu(), getattr(theirs, name)), name
    assert ours.slots._free == theirs.slots._free


def rows(slots, seed, kvh=2, d=16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(slots), kvh, d, generator=g)
    v = torch.randn(len(slots), kvh, d, generator=g)
    k[:, 0, 2] = 0.37  # a constant key channel: the minimum scale
    k[:, 1, 5] *= 30.0  # an outlier key channel
    v[0, 1] = -1.25  # a constant value row
    return k.to(device), v.to(device), torch.tensor(slots, device=device)


# block size 4: block b holds slots 4b..4b+3. Sequence A lives in blocks 0-3, B in 5-6.
STEPS = [
    [0, 1, 2],  # A opens block 0
    [3, 4, 5, 6, 7, 8, 20, 21],  # A fills block 0 mid-write, then all of block 1, opens 2; B opens 5
    [9, 22],  # decode
    [10, 11, 23, 24],  # A fills 2; B fills 5 and opens 6
]


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
def test_store_matches_the_torch_path(device, bits):
    """One residual slot per sequence: a write takes none for the blocks it fills."""
    ours = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2, device=device)
    theirs = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2)
    for i, slots in enumerate(STEPS):
        k, v, s = rows(slots, i, device=device)
        pks.store_packed_kv(k, v, ours, s)
        pks.reference_store_packed_kv(k.cpu(), v.cpu(), theirs, s.cpu())
        assert_same_layer(ours, theirs)
    assert ours.open_blocks == 1  # block 6
    for layer in (ours, theirs):  # B freed while its block is open: the slot goes back, block 3 reuses it
        layer.release(6)
    k, v, s = rows([12], 9, device=device)
    pks.store_packed_kv(k, v, ours, s)
    pks.reference_store_packed_kv(k.cpu(), v.cpu(), theirs, s.cpu())
    assert_same_layer(ours, theirs)


def test_store_clips_int2_key_ranges_as_the_torch_path(device):
    """One token stretching every key channel of a block: most int2 channels store a clipped range
    (a scale below the full range's), the kernel the same ones as the torch path."""
    ours = packed_layer(2, block_size=16, num_blocks=2, residual_blocks=1, device=device)
    theirs = packed_layer(2, block_size=16, num_blocks=2, residual_blocks=1)
    k, v, s = rows(list(range(16)), 5, device=device)
    k[3] *= 8.0
    pks.store_packed_kv(k, v, ours, s)
    pks.reference_store_packed_kv(k.cpu(), v.cpu(), theirs, s.cpu())
    assert_same_layer(ours, theirs)
    full_range_scale = (k.amax(0) - k.amin(0)).cpu() / 3
    assert (theirs.k_scale[0].float() < 0.99 * full_range_scale).float().mean() > 0.5


def test_a_sequences_first_block_keeps_its_full_key_ranges(device):
    """Positions mark a sequence's first block (its attention sinks): its int2 key ranges are not
    clipped, a later block's are; the kernel as the torch path."""
    ours = packed_layer(2, block_size=16, num_blocks=4, residual_blocks=2, device=device)
    theirs = packed_layer(2, block_size=16, num_blocks=4, residual_blocks=2)
    k, v, s = rows(list(range(32)), 7)
    k[3] *= 8.0
    k[19] *= 8.0
    for layer, store, dev in ((ours, pks.store_packed_kv, device), (theirs, pks.reference_store_packed_kv, "cpu")):
        plan = layer.slots.apply(WritePlan.of(s, 16, dev, positions=torch.arange(32)))
        store(k.to(dev), v.to(dev), layer, s.to(dev), plan=plan)
    assert_same_layer(ours, theirs)
    blocks = k.view(2, 16, 2, 16)
    full_range_scale = (blocks.amax(1) - blocks.amin(1)) / 3
    torch.testing.assert_close(theirs.k_scale[0].float(), full_range_scale[0], rtol=1e-3, atol=0)
    assert (theirs.k_scale[1].float() < 0.99 * full_range_scale[1]).float().mean() > 0.5


def per_row(layer, slots: list[int], rows: int, device) -> WritePlan:
    """The write of ``slots`` planned and applied to ``layer``'s table, one entry per row padded
    to ``rows`` (what a CUDA graph's decode step reads from its persistent buffers)."""
    plan = layer.slots.apply(WritePlan.of(torch.tensor(slots), layer.block_size, "cpu")).per_row_plan(rows)
    return replace(plan, full=plan.full.to(device), src=plan.src.to(device), stays=plan.stays.to(device),
                   full_slots=plan.full_slots.to(device))


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
def test_per_row_plans_store_as_the_torch_path(device, bits):
    """Fixed launch shapes: every row of the plan launched, two padded rows (slot -1) that fill
    and keep nothing; the kernels (and the torch path, which compacts the plan) match the write
    planned per block, bit for bit."""
    ours = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2, device=device)
    torch_path = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2)
    theirs = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2)
    for i, slots in enumerate(STEPS):
        k, v, s = rows(slots + [-1, -1], i, device=device)
        pks.store_packed_kv(k, v, ours, s, plan=per_row(ours, slots, len(s), device))
        pks.reference_store_packed_kv(k.cpu(), v.cpu(), torch_path, s.cpu(), plan=per_row(torch_path, slots, len(s), "cpu"))
        pks.reference_store_packed_kv(k[:-2].cpu(), v[:-2].cpu(), theirs, s[:-2].cpu())
        assert_same_layer(ours, theirs)
        assert_same_layer(torch_path, theirs)


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
def test_blocks_filled_within_one_write_need_no_residual_slot(device, bits):
    """Two sequences in one write fill four blocks (one open since an earlier write, three whole)
    and leave two open: two residual slots suffice, and every filled block is quantized from
    exactly its rows, those written earlier and now."""
    ours = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2, device=device)
    theirs = packed_layer(bits, block_size=4, num_blocks=8, residual_blocks=2)
    # B opens block 5; then A: blocks 0, 1 and offsets 0..2 of 2; B: fills 5, block 3, offsets 0..1 of 4
    steps = [[20, 21, 22], [*range(0, 11), 23, *range(12, 18)], [11, 18, 19]]
    for i, slots in enumerate(steps):
        k, v, s = rows(slots, i, device=device)
        pks.store_packed_kv(k, v, ours, s)
        pks.reference_store_packed_kv(k.cpu(), v.cpu(), theirs, s.cpu())
        assert_same_layer(ours, theirs)
        if i == 1:
            assert {int(b) for b in (ours.slot_of >= 0).nonzero()} == {2, 4}
            first_k = rows(steps[0], 0)[0]
            codes, _, _ = quantize_key_blocks(torch.cat([first_k, k[11:12].cpu()])[None], ours.bits.keys)
            assert torch.equal(ours.k_codes[5].cpu(), codes[0])
    assert ours.open_blocks == 0 and sorted(ours.slots._free) == [0, 1]


# key bits -> (channel values, the codes of the last two): int4 [0, 15] scale 1, 2.5 -> 2, 7.5 -> 8;
# 3-bit [0, 7] scale 1, 2.5 -> 2, 3.5 -> 4; int2 [0, 7.5] scale 2.5, 0.5 -> 0, 1.5 -> 2
TIES = {4: ([0.0, 15.0, 2.5, 7.5], (2, 8)), 3: ([0.0, 7.0, 2.5, 3.5], (2, 4)), 2: ([0.0, 7.5, 1.25, 3.75], (0, 2))}


@pytest.mark.parametrize("bits", [4, "k3v2", 2])
def test_exact_rounding_ties_take_the_even_code(device, bits):
    """A key channel whose range puts two values exactly half way between codes."""
    ours = packed_layer(bits, block_size=4, num_blocks=2, residual_blocks=1, device=device)
    theirs = packed_layer(bits, block_size=4, num_blocks=2, residual_blocks=1)
    values, ties = TIES[ours.bits.keys]
    k, v, s = rows([0, 1, 2, 3], 0, device=device)
    k[:, 0, 0] = torch.tensor(values, device=device)
    pks.store_packed_kv(k, v, ours, s)
    pks.reference_store_packed_kv(k.cpu(), v.cpu(), theirs, s.cpu())
    assert_same_layer(ours, theirs)
    codes = unpack(ours.k_codes[0].cpu(), ours.bits.keys)
    assert (int(codes[2, 0, 0]), int(codes[3, 0, 0])) == ties


# Decode (q_len 1, its block open), a prefill over several blocks that fills some mid-write, and
# an extend whose new tokens fill a block and open the next; block sizes below 16 look keys up
# one by one, 16 and up read whole tiles of one block.
CASES = [  # (heads, kv heads, head dim, block size, window, softcap, splits)
    (6, 2, 16, 4, None, None, None),  # GQA 3
    (4, 1, 16, 4, 5, None, 2),  # MQA, sliding window, split context
    (4, 4, 32, 16, None, 30.0, None),  # MHA, softcap
    (6, 2, 16, 32, 20, None, 3),  # GQA, window, split
    (4, 2, 24, 16, None, None, None),  # a head_dim that is no power of 2
]


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
@pytest.mark.parametrize("H,KVH,D,block_size,window,softcap,splits", CASES)
def test_packed_attention_matches_the_torch_path(device, bits, H, KVH, D, block_size, window, softcap, splits):
    scale_up = block_size // 4 if block_size > 4 else 1
    ctx, qlen = [9 * scale_up, 1, 13 * scale_up, 6 * scale_up + 1], [9 * scale_up, 1, 3 * scale_up, 1]
    b = make_packed_batch(ctx, qlen, H, KVH, D, bits, block_size, device=device, store=pks.store_packed_kv)
    assert b.cache.open_blocks == 4  # every sequence's last block
    kw = dict(scale=D ** -0.5, window=window, softcap=softcap)
    out = ppa.packed_paged_attention(*b.args(), num_splits=splits, **kw)
    ref = ppa.reference_packed_paged_attention(*b.args(), **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


SINK_CASES = [  # (heads, kv heads, head dim, block size, window, sinks, splits)
    (4, 1, 16, 4, 5, 3, 2),  # keys looked up one by one, split context
    (6, 2, 16, 32, 20, 6, None),  # whole-block tiles
    (4, 4, 16, 16, 8, 20, 2),  # sinks past the window's start
]


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
@pytest.mark.parametrize("H,KVH,D,block_size,window,sinks,splits", SINK_CASES)
def test_packed_sinks_match_the_torch_path(device, bits, H, KVH, D, block_size, window, sinks, splits):
    scale_up = block_size // 4
    ctx, qlen = [9 * scale_up, 1 + 8 * scale_up, 13 * scale_up, 6 * scale_up + 1], [9 * scale_up, 1, 3 * scale_up, 1]
    b = make_packed_batch(ctx, qlen, H, KVH, D, bits, block_size, device=device, store=pks.store_packed_kv)
    kw = dict(scale=D ** -0.5, window=window)
    out = ppa.packed_paged_attention(*b.args(), num_splits=splits, sinks=sinks, **kw)
    ref = ppa.reference_packed_paged_attention(*b.args(), sinks=sinks, **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


ROPE_CASES = [  # (heads, kv heads, head dim, block size, window, sinks, splits)
    (6, 2, 16, 4, None, 0, None),  # keys looked up one by one
    (4, 1, 16, 32, 20, 6, 3),  # whole-block tiles, window, sinks, split context
]


@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
@pytest.mark.parametrize("H,KVH,D,block_size,window,sinks,splits", ROPE_CASES)
def test_keys_stored_before_rope_are_rotated_as_the_torch_path(device, bits, H, KVH, D, block_size, window, sinks,
                                                                splits):
    """The kernel dequantizes each key and its rotate-half partner channel and rotates them at the
    key's position; the reference rotates the gathered keys with ``KeyRope.rotate``."""
    scale_up = block_size // 4
    ctx, qlen = [9 * scale_up, 1 + 8 * scale_up, 13 * scale_up, 6 * scale_up + 1], [9 * scale_up, 1, 3 * scale_up, 1]
    b = make_packed_batch(ctx, qlen, H, KVH, D, bits, block_size, device=device, store=pks.store_packed_kv)
    rope = KeyRope.of(RopeSpec("default", 100.0), D, 4096)  # base 100: every channel pair turns within the context
    kw = dict(scale=D ** -0.5, window=window, sinks=sinks, key_rope=rope)
    out = ppa.packed_paged_attention(*b.args(), num_splits=splits, **kw)
    ref = ppa.reference_packed_paged_attention(*b.args(), **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    unrotated = ppa.reference_packed_paged_attention(*b.args(), **{**kw, "key_rope": None})
    assert not torch.allclose(unrotated, ref, atol=1e-3)  # the rotation is in effect


@pytest.mark.parametrize("block_size", [4, 16])
def test_open_block_is_read_exactly_from_the_residual(device, block_size):
    """A context shorter than a block is all residual: plain attention over the exact K/V."""
    b = make_packed_batch([3], [3], 4, 2, 16, 4, block_size, device=device)
    out = ppa.packed_paged_attention(*b.args(), scale=0.25)
    pos = torch.arange(3)
    exact = reference_attention(b.q.cpu(), b.k[0], b.v[0], pos, pos, 0.25)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out.cpu(), exact, rtol=tol, atol=tol)


def open_first_blocks(b) -> None:
    """Give every sequence's block 0 a residual slot holding its exact rows, as a layer that keeps
    its first block exact does (int2's attention sinks)."""
    bs = b.cache.block_size
    for s in range(len(b.k)):
        slot = int(b.cache.slot_of.max()) + 1
        b.cache.slot_of[b.block_tables[s, 0].long()] = slot
        n = min(bs, len(b.k[s]))
        b.cache.k_residual[slot, :n] = b.k[s][:n].to(b.cache.k_residual)
        b.cache.v_residual[slot, :n] = b.v[s][:n].to(b.cache.v_residual)


@pytest.mark.parametrize("bits,rope", [(4, False), (2, False), (2, True), ("k4v2", False),
                                       ("k3v2", True)])
@pytest.mark.parametrize("window,sinks,splits", [(None, 0, None), (None, 0, 3), (40, 4, 2)])
def test_open_first_and_last_blocks_are_read_after_the_loop(device, bits, rope, window, sinks, splits):
    """Whole-block tiles read codes only; block 0 and the last cached block, both open, come from
    their residual rows after the loop: in every split, beside the step's own rows or without them;
    with keys stored before RoPE (int2's setup) rotated there too."""
    ctx, qlen = [75, 1, 40, 16], [11, 1, 1, 1]  # a cached partial block, a one-block sequence, decodes
    b = make_packed_batch(ctx, qlen, 4, 2, 16, bits, 16, device=device, store=pks.store_packed_kv)
    open_first_blocks(b)
    key_rope = KeyRope.of(RopeSpec("default", 100.0), 16, 4096) if rope else None
    kw = dict(scale=0.25, window=window, sinks=sinks, key_rope=key_rope)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    for k, v in ((b.k_new, b.v_new), (None, None)):
        args = (b.q, k, v, *b.args()[3:])
        out = ppa.packed_paged_attention(*args, num_splits=splits, **kw)
        torch.testing.assert_close(out, ppa.reference_packed_paged_attention(*args, **kw), rtol=tol, atol=tol)


def test_an_open_block_between_the_first_and_last_is_refused(device):
    b = make_packed_batch([70], [1], 4, 2, 16, 4, 16, device=device, store=pks.store_packed_kv)
    b.cache.slot_of[b.block_tables[0, 2].long()] = int(b.cache.slot_of.max()) + 1
    with pytest.raises(KvslimError, match="sequence 0's block 2 is open"):
        ppa.packed_paged_attention(*b.args(), scale=0.25)


def test_an_open_block_a_window_no_longer_reads_is_allowed(device):
    """A window releases blocks behind it and the batch points their entries at block 0, which may
    be another sequence's open block: only blocks some query still reads are checked."""
    b = make_packed_batch([70, 5], [1, 1], 4, 2, 16, 4, 16, device=device, store=pks.store_packed_kv)
    b.block_tables[0, 1] = b.block_tables[1, 0]  # sequence 1's open block, where sequence 0's released one was
    assert int(b.cache.slot_of[b.block_tables[1, 0].long()]) >= 0
    with pytest.raises(KvslimError, match="sequence 0's block 1 is open"):
        ppa.packed_paged_attention(*b.args(), scale=0.25)
    out = ppa.packed_paged_attention(*b.args(), scale=0.25, window=20)  # keys from 50 on: blocks 3 and 4
    ref = ppa.reference_packed_paged_attention(*b.args(), scale=0.25, window=20)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


# first_pos mid-block and mid key tile: block 4 looks keys up one by one, block 16 reads 16-key
# tiles of one block. A prefill chunk after earlier steps (its first tile straddles first_pos,
# the block it fills mid-chunk read from codes below first_pos and exact above) and decodes
# whose write closes their block.
@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
@pytest.mark.parametrize("block_size,splits", [(4, None), (16, None), (16, 2)])
def test_the_steps_own_rows_are_read_exact(device, bits, block_size, splits):
    m = block_size // 4
    ctx, qlen = [11 * m + 1, 8 * m, 4 * m, 5 * m], [6 * m - 1, 1, 1, 3 * m]  # first_pos 5m + 2, 8m - 1, 4m - 1, 2m
    b = make_packed_batch(ctx, qlen, 6, 2, 16, bits, block_size, device=device, store=pks.store_packed_kv)
    assert all(int(b.cache.slot_of[b.block_tables[s, blk].long()]) < 0 for s, blk in ((1, 1), (2, 0)))  # decodes closed them
    kw = dict(scale=0.25, num_splits=splits)
    out = ppa.packed_paged_attention(*b.args(), **kw)
    ref = ppa.reference_packed_paged_attention(*b.args(), scale=0.25)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    cached = ppa.packed_paged_attention(b.q, None, None, *b.args()[3:], **kw)
    torch.testing.assert_close(cached, ppa.reference_packed_paged_attention(b.q, None, None, *b.args()[3:], scale=0.25),
                               rtol=tol, atol=tol)
    for s in range(4):  # the rows read exact are ones the cache holds quantized
        a, z = int(b.query_start_loc[s]), int(b.query_start_loc[s + 1])
        assert (out[a:z] - cached[a:z]).abs().max() > 1e-3, s


def test_reference_store_is_the_layers_own_write():
    ours, theirs = packed_layer(4), packed_layer(4)
    k, v, s = rows([0, 1, 2, 3, 4], 0)
    pks.reference_store_packed_kv(k, v, ours, s)
    theirs.write(k, v, s)
    assert_same_layer(ours, theirs)


def test_bad_inputs_raise_one_line_errors():
    b = make_packed_batch([5], [1], 4, 2, 16, 4)
    k, v, s = rows([0], 0)
    with pytest.raises(KvslimError, match="slot_mapping must be int64"):
        pks.reference_store_packed_kv(k, v, b.cache, s.int())
    with pytest.raises(KvslimError, match="new k/v"):
        pks.reference_store_packed_kv(k[:, :1], v[:, :1], b.cache, s)
    with pytest.raises(KvslimError, match="not a multiple"):
        ppa.reference_packed_paged_attention(b.q[:, :3], *b.args()[1:], scale=1.0)
    with pytest.raises(KvslimError, match="k/v must be"):
        ppa.reference_packed_paged_attention(b.q, b.k_new.half(), *b.args()[2:], scale=1.0)
    with pytest.raises(KvslimError, match="given together"):
        ppa.reference_packed_paged_attention(b.q, None, *b.args()[2:], scale=1.0)
    with pytest.raises(KvslimError, match="cannot rotate"):
        ppa.reference_packed_paged_attention(*b.args(), scale=1.0, key_rope=KeyRope((1.0,) * 4))
    b.cache.k_scale = b.cache.k_scale.float()
    with pytest.raises(KvslimError, match="k_scale must be torch.float16"):
        ppa.reference_packed_paged_attention(*b.args(), scale=1.0)


# ------------------------------------------------------------------ GPU: real sizes, bf16
@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2, "k4v2", "k3v2"])
@pytest.mark.parametrize("H,KVH,D,block_size,window", [(9, 3, 64, 64, None), (32, 8, 128, 64, None), (8, 1, 256, 16, 512),
                                                       (8, 2, 128, 8, None)])
def test_gpu_packed_kv_real_sizes(bits, H, KVH, D, block_size, window):
    ctx, qlen = [1500, 7, 900, 2048, 333], [1, 7, 1, 130, 1]
    b = make_packed_batch(ctx, qlen, H, KVH, D, bits, block_size, device="cuda", store=pks.store_packed_kv)
    theirs = make_packed_batch(ctx, qlen, H, KVH, D, bits, block_size)
    for name in TENSORS:
        assert torch.equal(getattr(b.cache, name).cpu(), getattr(theirs.cache, name)), name
    args = (b.q.bfloat16(), b.k_new.bfloat16(), b.v_new.bfloat16(), *b.args()[3:])
    rope = KeyRope.of(RopeSpec("default", 10000.0), D, 4096) if b.cache.keys_before_rope else None
    kw = dict(scale=D ** -0.5, window=window, key_rope=rope)
    out = ppa.packed_paged_attention(*args, **kw).float()
    ref = reference_with_tiles_in(torch.bfloat16, *args, **kw).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def reference_with_tiles_in(dtype, *args, **kw):
    """The torch path with the gathered K/V rounded to ``dtype``, as the kernel's dots read them:
    4- and 2-bit codes dequantized in fp32 and then rounded to bf16 move a few peaky rows of random
    data by up to 0.075 from the fp32 oracle (on a GPU and in a CPU emulation alike), far beyond
    the kernel's own error."""
    attend = ppa.attend_sequences

    def rounded(q, gather, *rest):
        def gather_rounded(s, ctx):
            k, v = gather(s, ctx)
            return k.to(dtype).float(), v.to(dtype).float()
        return attend(q, gather_rounded, *rest)

    with mock.patch.object(ppa, "attend_sequences", rounded):
        return ppa.reference_packed_paged_attention(*args, **kw)
