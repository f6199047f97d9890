"""The paged backend against reference_attention, over random chunked steps of several sequences."""
import random

import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.attention.backend import AttentionParams, reference_attention
from runtime.attention.key_rope import KeyRope
from runtime.attention.paged import PagedAttentionBackend, PagedBatch
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.kv_quant import (
    QUANT_DTYPES,
    dequantize,
    quantize_per_token_head,
    quantize_static,
)
from runtime.cache.low_bit_kv import dequantize_keys, dequantize_values, quantize_key_blocks, quantize_value_rows
from runtime.engine.block_manager import BlockManager, PrefixHit
from runtime.model.spec import RopeSpec

WINDOW = 5
CONFIG = dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8,
    sliding_window=WINDOW,
    layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    kv_source_layers=[0, 1, 0, 3],
)


def _roundtrip(x, kv_dtype, static_scale):
    if kv_dtype not in QUANT_DTYPES:
        return x.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]).float()
    qd = QUANT_DTYPES[kv_dtype]
    if static_scale is not None:
        return dequantize(quantize_static(x, torch.tensor(static_scale), qd), torch.tensor(static_scale))
    return dequantize(*quantize_per_token_head(x, qd))


@pytest.mark.parametrize(
    "kv_dtype,static,softcap,sinks",
    [("fp32", False, None, 0), ("bf16", False, 5.0, 0), ("fp8_e4m3", False, None, 0), ("int8", False, None, 0),
     ("int8", True, None, 0), ("fp32", False, None, 3), ("bf16", False, 5.0, 6), ("int8", False, None, 1)],
)
def test_paged_matches_reference(kv_dtype, static, softcap, sinks):
    torch.manual_seed(0)
    rng = random.Random(0)
    layout = AttentionLayout.from_config({**CONFIG, "num_sink_tokens": sinks})
    bs = 4
    spec = KVCacheSpec.from_layout(layout, kv_dtype, block_size=bs, static_scales=static)
    assert [g.layers for g in spec.groups] == [(0,), (1, 3)]
    assert spec.layer_slots == ((0, 0), (1, 0), (0, 0), (1, 1))
    scales = {i: (0.05, 0.04) for i in layout.cache_owners()} if static else None
    cache = KVCache(spec, (64, 64), layer_scales=scales)
    bm = BlockManager((64, 64), bs, spec.windows, enable_prefix_caching=False, sinks=spec.sinks)
    params = [AttentionParams(0.35, l.window, l.kv_source, softcap, l.sinks) for l in layout.layers]
    backend = PagedAttentionBackend(cache, params)
    H, KVH, D = 4, 2, 8
    targets = {0: 21, 1: 3, 2: 17}  # final lengths
    computed = {s: 0 for s in targets}
    hist = {(s, i): ([], []) for s in targets for i in layout.cache_owners()}
    step = 0
    while any(computed[s] < targets[s] for s in targets):
        step += 1
        active = [s for s in targets if computed[s] < targets[s] and (step > 1 or s != 2)]
        firsts, lens, tables = [], [], []
        for s in active:
            n = min(targets[s] - computed[s], rng.choice([1, 1, 2, 3, 6]))
            if s not in bm.tables:
                assert bm.allocate(s, PrefixHit(0, ((), ()), ()), n)
            else:
                bm.release_window(s, computed[s])
                assert bm.append(s, computed[s], computed[s] + n)
            firsts.append(computed[s])
            lens.append(n)
            tables.append(bm.block_tables(s))
        batch = PagedBatch.build(bs, firsts, lens, tables)
        backend.set_batch(batch)
        T = sum(lens)
        step_kv = {}
        for layer, la in enumerate(layout.layers):
            q = torch.randn(T, H, D)
            owner = la.kv_source == layer
            k = torch.randn(T, KVH, D) if owner else None
            v = torch.randn(T, KVH, D) if owner else None
            if owner:
                step_kv[layer] = (k, v)
            out = backend.attend(layer, q, k, v)
            row = 0
            for s, first, n in zip(active, firsts, lens):
                ks, vs = hist[(s, la.kv_source)]
                if owner:
                    st = scales[layer] if static else (None, None)
                    ks.append(_roundtrip(k[row:row + n], kv_dtype, st[0]))
                    vs.append(_roundtrip(v[row:row + n], kv_dtype, st[1]))
                kk, vv = torch.cat(ks), torch.cat(vs)
                if kv_dtype in ("fp8_e4m3", "int8"):  # a quantized cache: the step's own rows are read exact
                    new_k, new_v = step_kv[la.kv_source]
                    kk, vv = torch.cat([kk[:first], new_k[row:row + n]]), torch.cat([vv[:first], new_v[row:row + n]])
                assert kk.shape[0] == first + n
                ref = reference_attention(
                    q[row:row + n], kk, vv, torch.arange(first, first + n), torch.arange(first + n),
                    0.35, la.window, softcap, la.sinks,
                )
                torch.testing.assert_close(out[row:row + n], ref, rtol=1e-4, atol=1e-4)
                row += n
        for s, n in zip(active, lens):
            computed[s] += n
    # Sliding group holds only the window's blocks; full group holds all.
    for s in targets:
        full, sliding = bm.block_tables(s)
        assert len([b for b in full if b >= 0]) == -(-targets[s] // bs)
        bm.release_window(s, targets[s])
        live = [b for b in sliding if b >= 0]
        assert len(live) <= -(-(WINDOW + bs - 1) // bs) + -(-sinks // bs)
        assert all(b >= 0 for b in sliding[:-(-sinks // bs)])  # the sink blocks stay
        bm.free(s)
    assert bm.num_free(0) == 64 and bm.num_free(1) == 64


@pytest.mark.parametrize("window,sinks", [(None, 0), (5, 0), (5, 3), (6, 9), (64, 2)])
def test_decode_plan_finds_each_new_key(window, sinks):
    """Each decoding token's own key among those read: the right block and offset (the read rule
    puts the exact new row there)."""
    from runtime.attention.paged import _plan

    bs = 4
    ctxs = [1, 3, 4, 5, 8, 9, 12, 13, 17, 21]
    table = torch.arange(len(ctxs) * 8, dtype=torch.int32).view(len(ctxs), 8) + 100
    batch = PagedBatch.build(bs, [c - 1 for c in ctxs], [1] * len(ctxs), [[row.tolist()] for row in table])
    plan = _plan(batch, batch.block_tables[0], window, sinks, torch.float32, False)
    for s, ctx in enumerate(ctxs):
        at = int(plan.decode_new_key[s])
        assert plan.decode_blocks[s, at // bs] == table[s, (ctx - 1) // bs] and at % bs == (ctx - 1) % bs, (ctx, at)


def test_a_short_context_reads_its_blocks_not_a_whole_window():
    """A window of 64 over contexts of at most 9 tokens reads the 3 blocks they hold (sink block
    included), not the 17 a full window spans: each read block is dequantized with int4/int2."""
    from runtime.attention.paged import _plan

    ctxs = [2, 5, 9]
    table = torch.arange(len(ctxs) * 20, dtype=torch.int32).view(len(ctxs), 20)
    batch = PagedBatch.build(4, [c - 1 for c in ctxs], [1] * len(ctxs), [[row.tolist()] for row in table])
    assert _plan(batch, batch.block_tables[0], 64, 2, torch.float32, False).decode_blocks.shape[1] == 3


def test_int2_keys_are_quantized_before_rope_and_rotated_on_read():
    """Two closed blocks hold int2 codes of the keys before RoPE: a decoded token reads the second
    dequantized, then rotated at their positions, the first exact (int2 keeps the sequence's first
    block exact); its own key exact and rotated. Values are stored and attended in the cache's
    rotated basis, and the output rotated back."""
    layout = AttentionLayout.from_config({**CONFIG, "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                          "kv_source_layers": [0]})
    bs, KVH, D = 4, 2, 8
    cache = KVCache(KVCacheSpec.from_layout(layout, "int2", block_size=bs), (4,), residual_blocks=2)
    assert cache.keys_before_rope(0)
    rope = KeyRope.of(RopeSpec("default", 100.0), D, 512)
    backend = PagedAttentionBackend(cache, [AttentionParams(0.35, None, 0, None, 0, rope)])
    g = torch.Generator().manual_seed(0)
    k, v, q = torch.randn(9, KVH, D, generator=g), torch.randn(9, KVH, D, generator=g), torch.randn(9, 4, D, generator=g)
    table = [[[0, 1, 2]]]
    backend.set_batch(PagedBatch.build(bs, [0], [8], table))
    backend.attend(0, q[:8], k[:8], v[:8])
    backend.set_batch(PagedBatch.build(bs, [8], [1], table))
    out = backend.attend(0, q[8:], k[8:], v[8:])

    keys = dequantize_keys(*quantize_key_blocks(k[:8].view(2, bs, KVH, D), 2), 2, torch.float32).reshape(8, KVH, D)
    rotation = cache.value_rotation(0)  # int2 values are stored, and attended, rotated
    values = dequantize_values(*quantize_value_rows(rotation.rotate(v[:8]), 2), 2, torch.float32)
    keys[:bs], values[:bs] = k[:bs], rotation.rotate(v[:bs])  # the first block, exact
    positions = torch.arange(9)
    kk = rope.rotate(torch.cat([keys, k[8:]]), positions)
    ref = reference_attention(q[8:], kk, torch.cat([values, rotation.rotate(v[8:])]), positions[8:], positions, 0.35)
    torch.testing.assert_close(out, rotation.restore(ref), rtol=1e-5, atol=1e-5)
    after_rope = dequantize_keys(*quantize_key_blocks(rope.rotate(k[:8], positions[:8]).view(2, bs, KVH, D), 2), 2,
                                 torch.float32).reshape(8, KVH, D)
    after_rope[:bs] = kk[:bs]
    old = reference_attention(q[8:], torch.cat([after_rope, kk[8:]]), torch.cat([values, v[8:]]), positions[8:],
                              positions, 0.35)
    assert not torch.allclose(out, old, atol=1e-3)  # not the layout that quantizes rotated keys


def test_int4_keys_are_quantized_after_rope_in_a_rotated_basis_and_queries_rotated_alike():
    """Two closed blocks hold int4 codes of the keys after RoPE, rotated: a decoded token reads
    them dequantized in that basis with its query rotated alike (the scores of the model's basis,
    up to quantization), its own key exact; values as they are."""
    layout = AttentionLayout.from_config({**CONFIG, "num_hidden_layers": 1, "layer_types": ["full_attention"],
                                          "kv_source_layers": [0]})
    bs, KVH, D = 4, 2, 8
    cache = KVCache(KVCacheSpec.from_layout(layout, "int4", block_size=bs), (4,), residual_blocks=2)
    basis = cache.key_rotation(0)
    assert basis is not None and cache.value_rotation(0) is None and not cache.keys_before_rope(0)
    rope = KeyRope.of(RopeSpec("default", 100.0), D, 512)
    backend = PagedAttentionBackend(cache, [AttentionParams(0.35, None, 0, None, 0, rope)])
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(9, KVH, D, generator=g), torch.randn(9, KVH, D, generator=g)
    q = torch.randn(9, 4, D, generator=g)
    table = [[[0, 1, 2]]]
    backend.set_batch(PagedBatch.build(bs, [0], [8], table))
    backend.attend(0, q[:8], k[:8], v[:8])
    backend.set_batch(PagedBatch.build(bs, [8], [1], table))
    out = backend.attend(0, q[8:], k[8:], v[8:])

    positions = torch.arange(9)
    kk = basis.rotate(rope.rotate(k, positions))
    keys = dequantize_keys(*quantize_key_blocks(kk[:8].view(2, bs, KVH, D), 4), 4, torch.float32).reshape(8, KVH, D)
    values = dequantize_values(*quantize_value_rows(v[:8], 4), 4, torch.float32)
    ref = reference_attention(basis.rotate(q[8:]), torch.cat([keys, kk[8:]]), torch.cat([values, v[8:]]),
                              positions[8:], positions, 0.35)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    exact = reference_attention(q[8:], rope.rotate(k, positions), v, positions[8:], positions, 0.35)
    torch.testing.assert_close(out, exact, rtol=0, atol=0.1)  # the model's scores, up to int4


@pytest.mark.parametrize("exact_first_block", [False, True])
def test_a_steps_write_plan_marks_each_sequences_first_block(exact_first_block):
    """The first block of a sequence keeps its full key ranges (``WritePlan.first``), whether or
    not its group also keeps it exact: a prefill filling blocks 3 and 5 (positions 0-7), and a
    sequence at positions 8-11 filling its second block, 6."""
    batch = PagedBatch.build(4, [0, 8], [8, 4], [[[3, 5]], [[1, 2, 6]]])
    plan = batch.write_plan(0, exact_first_block)
    assert plan.full_blocks == (3, 5, 6) and plan.first.tolist() == [True, False, False]
    assert (3 in plan.open_blocks) == exact_first_block
