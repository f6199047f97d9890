"""int4 / int2 / k4v2 KV: codes and parameters, the open block kept exact, and the engine around them."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.low_bit_kv import (
    LOW_BIT_KV,
    bytes_per_token_head,
    dequantize_keys,
    dequantize_values,
    pack,
    quantize_key_blocks,
    quantize_value_rows,
    unpack,
)
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model

FP16_EPS = 2**-10  # relative rounding of the fp16 minimum
TIE = 1e-2  # logprob gap under which two greedy choices may swap when batches differ
# A prefix hit reads its shared blocks quantized where a fresh prefill attends its prompt exact: on
# a random tiny model (block 8) that moves logprobs by 0.09 on average at int4, 0.31 at int2
# (k4v2's and k3v2's 2-bit values: int2's bound).
QUANT_TIE = {"int4": 1e-1, "int2": 1.0, "k4v2": 1.0, "k3v2": 1.0}


@pytest.mark.parametrize("bits", [4, 3, 2])  # 3: a 2-bit plane, then a 1-bit one
def test_pack_round_trips(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    assert pack(codes, bits).shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


def _bound(x: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return scale.float() / 2 + lo.float().abs() * FP16_EPS + x.abs() * 1e-6 + 1e-6


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 3, 2]), blocks=st.integers(1, 3), kvh=st.integers(1, 3),
       kind=st.sampled_from(["normal", "outlier_channel", "all_equal", "zeros"]), seed=st.integers(0, 2**16))
def test_round_trip_error_is_half_a_step(bits, blocks, kvh, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, 16, kvh, 32, generator=g)
    if kind == "outlier_channel":
        x[..., 3] *= 50.0
    elif kind == "all_equal":
        x[:] = 0.37
    elif kind == "zeros":
        x.zero_()
    with mock.patch("runtime.cache.low_bit_kv.CLIPPED_KEY_BITS", frozenset()):
        codes, scale, lo = quantize_key_blocks(x, bits)
    keys = dequantize_keys(codes, scale, lo, bits, torch.float32)
    assert ((keys - x).abs() <= _bound(x, scale.unsqueeze(1), lo.unsqueeze(1))).all()
    codes, scale, lo = quantize_value_rows(x, bits)
    values = dequantize_values(codes, scale, lo, bits, torch.float32)
    assert ((values - x).abs() <= _bound(x, scale.unsqueeze(-1), lo.unsqueeze(-1))).all()
    if kind in ("all_equal", "zeros"):  # one level: the value itself, as fp16 stores it
        assert torch.equal(keys, x.half().float()) and torch.equal(values, x.half().float())


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["normal", "outlier_token", "outlier_channel", "all_equal"]), seed=st.integers(0, 2**16))
def test_clipped_keys_reconstruct_no_worse_than_their_full_range(kind, seed):
    """Clipped int2 key channels: squared error per channel at most the full range's (which is a
    candidate), strictly less where one token stretches a channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 64, 2, 32, generator=g)
    if kind == "outlier_token":
        x[:, 5, :, :] *= 20.0
    elif kind == "outlier_channel":
        x[..., 3] *= 50.0
    elif kind == "all_equal":
        x[:] = 0.37

    def channel_error(clip: frozenset) -> torch.Tensor:
        with mock.patch("runtime.cache.low_bit_kv.CLIPPED_KEY_BITS", clip):
            keys = dequantize_keys(*quantize_key_blocks(x, 2), 2, torch.float32)
        return (keys - x).square().sum(1)

    clipped, full = channel_error(frozenset({2})), channel_error(frozenset())
    assert (clipped <= full).all()
    if kind == "outlier_token":
        assert (clipped < full).float().mean() > 0.9


def _cache(tiny_llama, kv_dtype: str, block_size: int = 8) -> KVCache:
    from foundation.attention_layout import AttentionLayout
    from foundation.checkpoint import Checkpoint

    layout = AttentionLayout.from_config(Checkpoint.open(tiny_llama).config)
    return KVCache(KVCacheSpec.from_layout(layout, kv_dtype, block_size), (6,), residual_blocks=2)


@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2", "k3v2"])
def test_open_block_is_exact_until_it_fills(tiny_llama, kv_dtype):
    cache = _cache(tiny_llama, kv_dtype)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(8, 2, 32, generator=g), torch.randn(8, 2, 32, generator=g)
    block = torch.tensor([3])
    cache.write(0, k[:7], v[:7], torch.arange(24, 31))  # block 3, offsets 0..6: still open
    assert layer.open_blocks == 1
    kk, vv = cache.gather(0, block, torch.float32)
    assert torch.equal(kk[:7], k[:7]) and torch.equal(vv[:7], v[:7])
    cache.write(0, k[7:], v[7:], torch.tensor([31]))  # the last offset: quantized in place now
    assert layer.open_blocks == 0
    kk, vv = cache.gather(0, block, torch.float32)
    assert not torch.equal(kk, k) and (kk - k).abs().max() < (k.abs().max() * 2)
    codes, scale, lo = quantize_key_blocks(k[None], LOW_BIT_KV[kv_dtype].keys)
    assert torch.equal(cache.tensors[0]["k_codes"][0, 3], codes[0])
    codes, scale, lo = quantize_value_rows(v, LOW_BIT_KV[kv_dtype].values)
    assert torch.equal(cache.tensors[0]["v_codes"][0, 3], codes)


def test_freed_open_block_gives_its_residual_back(tiny_llama):
    cache = _cache(tiny_llama, "int4")
    k = torch.randn(3, 2, 32)
    cache.write(0, k, k, torch.tensor([0, 1, 2]))  # block 0 open
    cache.write(0, k, k, torch.tensor([8, 9, 10]))  # block 1 open: both residual blocks in use
    assert cache.layers[0].open_blocks == 2
    cache.release_block(0, 0)
    cache.write(0, k, k, torch.tensor([16, 17, 18]))  # a third open block fits again
    assert cache.layers[0].open_blocks == 2


def test_blocks_filled_within_one_write_need_no_residual_slot(tiny_llama):
    """Two prompts prefilled in one step fill four blocks and leave two open: two slots suffice, and
    each filled block is quantized from exactly its rows (those written earlier and now)."""
    cache = _cache(tiny_llama, "int4")  # block 8, two residual slots
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    cache.write(0, k, v, torch.tensor([40, 41, 42]))  # block 5 open since an earlier step
    rows_k, rows_v = torch.randn(26, 2, 32, generator=g), torch.randn(26, 2, 32, generator=g)
    # blocks 0, 1 and offsets 0..2 of 2 (prompt A); offsets 3..7 of block 5, then block 3 (prompt B)
    slots = torch.cat([torch.arange(0, 19), torch.arange(43, 48), torch.arange(24, 26)])
    cache.write(0, rows_k, rows_v, slots)
    layer = cache.layers[0]
    assert layer.open_blocks == 2 and {int(b) for b in (layer.slot_of >= 0).nonzero()} == {2, 3}
    for block, kk in ((0, rows_k[0:8]), (1, rows_k[8:16]), (5, torch.cat([k, rows_k[19:24]]))):
        codes, _, _ = quantize_key_blocks(kk[None], 4)
        assert torch.equal(cache.tensors[0]["k_codes"][0, block], codes[0]), block
    got_k, got_v = cache.gather(0, torch.tensor([2]), torch.float32)
    assert torch.equal(got_k[:3], rows_k[16:19]) and torch.equal(got_v[:3], rows_v[16:19])


def test_bytes_per_token(tiny_llama):
    # SmolLM2's head_dim 64 at block 64: int4 72 B per token and head (3.56x smaller than bf16's
    # 256), k4v2 56 B (4.57x: 32 B of key codes, 16 of value codes), k3v2 48 B (5.33x), int2 40 B
    # (6.4x), codes and parameters included.
    assert [bytes_per_token_head(64, LOW_BIT_KV[kv], 64) for kv in ("int4", "k4v2", "k3v2", "int2")] == [72, 56, 48, 40]
    cache = _cache(tiny_llama, "int4", block_size=8)
    spec = cache.spec
    per_block = spec.block_bytes(0)
    assert cache.group_nbytes(0) == 6 * per_block + 2 * spec.residual_block_bytes(0, torch.float32)


# int2, k4v2 and k3v2 also keep each first block exact
@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2", "k3v2"])
def test_engine_prefix_hits_and_preemption_with_low_bit_kv(tiny_llama, kv_dtype):
    model = load_model(tiny_llama, "float32")
    system = torch.arange(100, 140).tolist()  # 40 shared tokens: 5 full blocks of 8
    g = torch.Generator().manual_seed(3)
    ps = [system + torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (12,), generator=g)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    config = dict(kv_dtype=kv_dtype, block_size=8, max_num_batched_tokens=64, max_model_len=96)
    roomy = Engine(model, EngineConfig(kv_cache_bytes=8 << 20, enable_prefix_caching=False, **config))
    ref = roomy.generate(ps, params)
    tight = Engine(model, EngineConfig(kv_cache_bytes=16 * roomy.kv_spec.block_bytes(0), **config))
    (num_blocks,) = tight.cache.num_blocks  # 16, or fewer where the budget also pays for exact first blocks
    assert num_blocks == 16 or tight.kv_spec.groups[0].exact_first_block and num_blocks >= 10
    out = tight.generate(ps, params)
    assert tight.stats.preemptions > 0 and tight.block_manager.prefix_hit_rate > 0.3
    assert [len(o.token_ids) for o in out] == [8] * len(ps)
    for o, r in zip(out, ref):  # the same tokens, up to a near-tie (prefix hits read quantized blocks)
        for t, (a, b) in enumerate(zip(o.token_ids, r.token_ids)):
            if a != b:
                top = r.logprobs[t].top
                assert top[0][1] - top[1][1] < QUANT_TIE[kv_dtype], f"tokens differ at {t} without a near-tie"
                break
    assert tight.block_manager.pools[0].num_free == num_blocks
    assert all(layer.open_blocks == 0 for layer in tight.cache.packed[0])


def test_a_token_reads_its_own_block_exact_and_earlier_blocks_quantized(tiny_llama):
    """What ``Engine.score`` measures at int4: every token as it would be decoded."""
    model = load_model(tiny_llama, "float32")
    ids = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(0)).tolist()  # 3 blocks of 8
    config = dict(block_size=8, max_num_batched_tokens=64, max_model_len=64, kv_cache_bytes=1 << 20)
    exact = Engine(model, EngineConfig(kv_dtype="fp32", **config)).score(ids)
    int4 = Engine(model, EngineConfig(kv_dtype="int4", **config))
    scored = int4.score(ids)  # block by block (the default for int4/int2)
    torch.testing.assert_close(scored[:8], exact[:8], rtol=0, atol=1e-4)  # nothing before block 0
    assert (scored[8:] - exact[8:]).abs().max() > 1e-3  # later blocks read quantized ones
    # Decoding one token at a time reads the same (the last token of a block, whose write
    # quantizes the block, reads its block-mates quantized; rows after it are then off slightly).
    decoded = int4.score(ids, pieces=[1] * 24)
    torch.testing.assert_close(decoded[:7], scored[:7], rtol=0, atol=1e-4)
    # A whole prompt in one step attends its own K/V exact (KIVI's full-precision prefill).
    torch.testing.assert_close(int4.score(ids, pieces=[24]), exact, rtol=0, atol=1e-4)
