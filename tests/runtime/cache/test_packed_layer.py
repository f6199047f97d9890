"""Packed int4/int2 layers: write plans, and a sequence's first block kept exact (int2)."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.low_bit_kv import EXACT_FIRST_BLOCK_BITS, LOW_BIT_KV
from runtime.cache.packed_layer import PackedLayerCache
from runtime.cache.write_plan import WritePlan

BS, KVH, D = 4, 2, 8
CONFIG = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": KVH,
          "hidden_size": 4 * D, "head_dim": D, "max_position_embeddings": 256}


def _layer(exact_first_block: bool, bits: int = 2, residual_blocks: int = 4) -> PackedLayerCache:
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(CONFIG), "int2" if bits == 2 else "int4", BS)
    lc = KVCache(spec, (8,), residual_blocks=residual_blocks).layers[0]
    lc.exact_first_block = exact_first_block  # both behaviours on one layout
    return lc


def _write(lc: PackedLayerCache, k, v, slots, positions):
    plan = WritePlan.of(slots, BS, positions=positions, keep_first_exact=lc.exact_first_block)
    lc.write(k, v, slots, lc.slots.apply(plan))


def test_plan_keeps_the_first_block_in_its_slot():
    slots, positions = torch.arange(10), torch.arange(10)  # blocks 0, 1 fill; block 2 stays open
    plain = WritePlan.of(slots, BS, positions=positions)
    assert plain.full_blocks == (0, 1) and plain.closed_blocks == (0, 1) and plain.open_blocks == (2,)
    assert plain.first.tolist() == [True, False]  # block 0 is the sequence's first: not clipped
    kept = WritePlan.of(slots, BS, positions=positions, keep_first_exact=True)
    assert kept.full_blocks == (0, 1) and kept.closed_blocks == (1,) and kept.open_blocks == (0, 2)
    assert kept.stays.tolist() == [True] * 4 + [False] * 4 + [True] * 2
    later = WritePlan.of(torch.tensor([23]), BS, positions=torch.tensor([7]), keep_first_exact=True)  # a later block
    assert later.closed_blocks == (5,) and later.open_blocks == () and later.first.tolist() == [False]
    assert WritePlan.of(slots, BS).first.tolist() == [False, False]  # no positions: every block may clip
    rows = _layer(False).slots.apply(plain).per_row_plan(12)  # a CUDA graph's: at the row filling each block
    assert rows.first.nonzero().flatten().tolist() == [3] and rows.compact().first.tolist() == [True, False]


def test_first_block_reads_exact_while_held_and_its_codes_after():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, KVH, D, generator=g), torch.randn(10, KVH, D, generator=g)
    exact, plain = _layer(True), _layer(False)
    for lc in (exact, plain):
        _write(lc, k[:6], v[:6], torch.arange(6), torch.arange(6))  # a 6-token prompt, then decode
        for t in range(6, 10):
            _write(lc, k[t:t + 1], v[t:t + 1], torch.tensor([t]), torch.tensor([t]))
    blocks = torch.arange(3)
    ke, ve = exact.gather(blocks, torch.float32)
    kp, vp = plain.gather(blocks, torch.float32)
    torch.testing.assert_close(ke[:BS], k[:BS], rtol=0, atol=0)  # its residual rows (fp32 here)
    torch.testing.assert_close(ve[:BS], v[:BS], rtol=0, atol=0)
    assert not torch.allclose(kp[:BS], k[:BS], atol=1e-3)  # int2 codes, as any block
    assert torch.equal(ke[BS:], kp[BS:]) and torch.equal(ve[BS:], vp[BS:])  # later blocks alike
    assert exact.open_blocks == 2 and plain.open_blocks == 1  # block 0 kept, block 2 open
    exact.release(0)  # the sequence ends: block 0 reads its codes (a later prefix hit's view)
    ke, ve = exact.gather(blocks, torch.float32)
    assert torch.equal(ke[:BS], kp[:BS]) and torch.equal(ve[:BS], vp[:BS])
    assert exact.open_blocks == 1


def test_a_prompt_filling_its_first_block_in_one_write_keeps_it():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(BS, KVH, D, generator=g), torch.randn(BS, KVH, D, generator=g)
    lc = _layer(True, residual_blocks=1)
    _write(lc, k, v, torch.arange(BS) + 3 * BS, torch.arange(BS))  # physical block 3, logical 0
    assert lc.open_blocks == 1 and lc.slot_host[3] == 0
    keys, values = lc.gather(torch.tensor([3]), torch.float32)
    assert torch.equal(values, v)
    with pytest.raises(Exception, match="exact first blocks"):  # no slot left for another sequence's
        _write(lc, k[:1], v[:1], torch.tensor([5 * BS]), torch.tensor([0]))


@pytest.mark.parametrize("kv_dtype", list(LOW_BIT_KV))
def test_bytes_per_token_count_the_exact_first_block(kv_dtype):
    layout = AttentionLayout.from_config(CONFIG)
    spec = KVCacheSpec.from_layout(layout, kv_dtype, BS)
    exact = bool(LOW_BIT_KV[kv_dtype].widths & EXACT_FIRST_BLOCK_BITS)  # k4v2: its 2-bit values
    assert spec.groups[0].exact_first_block == exact
    assert spec.residual_blocks_per_seq == (2 if exact else 1)
    codes = layout.kv_bytes_per_token(64, spec.element_bytes(0), spec.scale_bytes(spec.groups[0]), [0])
    block = 2 * BS * KVH * D * 2  # K and V of one bf16 block
    assert spec.kv_bytes_per_token(layout, 64) == pytest.approx(codes + (block / 64 if exact else 0))
