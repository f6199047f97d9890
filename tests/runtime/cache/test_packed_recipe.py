"""``PackedRecipe``: the runtime's rules per code width, and the variants a KV dtype name asks for,
reaching the cache an engine allocates."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from foundation.errors import KvslimError
from runtime.cache import low_bit_kv
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.low_bit_kv import LOW_BIT_KV
from runtime.cache.packed_recipe import PackedRecipe

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 256, "max_position_embeddings": 512}


@pytest.mark.parametrize("kv_dtype", list(LOW_BIT_KV))
def test_defaults_are_the_width_rules(kv_dtype):
    bits = LOW_BIT_KV[kv_dtype]
    r = PackedRecipe.of(bits)
    assert r.keys_before_rope == (bits.keys in low_bit_kv.KEYS_BEFORE_ROPE_BITS)
    assert r.keys_rotated == (bits.keys in low_bit_kv.KEYS_ROTATED_BITS)
    assert r.keys_clipped == (bits.keys in low_bit_kv.CLIPPED_KEY_BITS)
    assert r.values_rotated == (bits.values in low_bit_kv.VALUES_ROTATED_BITS)
    assert r.exact_first_block == bool(bits.widths & low_bit_kv.EXACT_FIRST_BLOCK_BITS)


def _cache(kv_dtype: str) -> KVCache:
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(CONFIG), kv_dtype, 16)
    return KVCache(spec, (4,), residual_blocks=2)


def test_variants_change_what_the_cache_stores():
    plain, unrotated = _cache("int4"), _cache("int4:keys-unrotated")
    assert plain.key_rotation(0) is not None and unrotated.key_rotation(0) is None
    assert not plain.spec.groups[0].exact_first_block and _cache("int4:exact-first-block").spec.groups[0].exact_first_block
    assert plain.spec.residual_blocks_per_seq == 1 and _cache("int4:exact-first-block").spec.residual_blocks_per_seq == 2
    assert _cache("int4:keys-clipped").layers[0].keys_clipped and not plain.layers[0].keys_clipped
    int2 = _cache("int2:keys-after-rope+values-unrotated+keys-unclipped")
    assert not int2.keys_before_rope(0) and int2.value_rotation(0) is None and not int2.layers[0].keys_clipped
    assert _cache("int2").keys_before_rope(0) and not _cache("int2:quantized-first-block").spec.groups[0].exact_first_block


def test_an_exact_first_block_costs_its_bytes():
    layout = AttentionLayout.from_config(CONFIG)
    plain, exact = (KVCacheSpec.from_layout(layout, kv, 16) for kv in ("int4", "int4:exact-first-block"))
    block = 2 * 2 * 16 * 2 * 64 * 2  # K and V, 2 layers, 16 tokens, 2 heads, head_dim 64, bf16
    assert exact.kv_bytes_per_token(layout, 256) == pytest.approx(plain.kv_bytes_per_token(layout, 256) + block / 256)


@pytest.mark.parametrize("kv_dtype, message", [
    ("int8:exact-first-block", "apply to packed KV"),
    ("int4:keys-after-rope", "keys-after-rope changes nothing for int4"),
    ("int2:exact-first-block", "exact-first-block changes nothing for int2"),
])
def test_a_variant_that_changes_nothing_is_refused(kv_dtype, message):
    with pytest.raises(KvslimError, match=message):
        KVCacheSpec.from_layout(AttentionLayout.from_config(CONFIG), kv_dtype, 16)


def test_a_mix_applies_a_variant_to_the_part_it_changes():
    layout = AttentionLayout.from_config({**CONFIG, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"]})
    spec = KVCacheSpec.from_layout(layout, "int4/int2:keys-unrotated", 16)
    recipes = {g.kv_dtype: g.recipe for g in spec.groups}
    assert not recipes["int4"].keys_rotated and recipes["int2"] == PackedRecipe.of(LOW_BIT_KV["int2"])


def test_engine_serves_a_variant_it_is_named(tiny_llama):
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import load_model

    model = load_model(tiny_llama, "float32")
    ids = torch.arange(3, 70).tolist()
    scores = {kv: Engine(model, EngineConfig(kv_dtype=kv, max_model_len=128, kv_cache_bytes=2 << 20)).score(ids)
              for kv in ("int4", "int4:keys-unrotated")}
    assert not torch.equal(scores["int4"], scores["int4:keys-unrotated"])  # another basis, other codes
    torch.testing.assert_close(scores["int4"], scores["int4:keys-unrotated"], rtol=0, atol=0.5)


@pytest.mark.parametrize("kv_dtype", ["int4", "int4:exact-first-block", "int2"])
def test_an_engine_sized_for_a_sequence_holds_it_with_its_exact_first_block(tiny_llama, kv_dtype):
    from runtime.engine.engine import Engine
    from runtime.model.loader import load_model

    engine = Engine.sized_for(load_model(tiny_llama, "float32"), 134, 1, max_num_batched_tokens=128, kv_dtype=kv_dtype)
    assert engine.score(torch.arange(3, 137).tolist()).shape[0] == 134
