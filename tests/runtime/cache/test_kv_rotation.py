"""The rotated bases of packed KV: orthonormal, spreading, score-keeping, and which caches use them."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.kv_rotation import KvRotation, randomized_hadamard
from runtime.cache.low_bit_kv import dequantize_values, quantize_value_rows

CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "hidden_size": 32, "layer_types": ["full_attention"], "kv_source_layers": [0]}


@pytest.mark.parametrize("d", [8, 64, 80])
def test_the_rotation_is_orthonormal_and_restores(d: int):
    r = randomized_hadamard(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
    rotation = KvRotation(d, "cpu")
    v = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rotation.restore(rotation.rotate(v)), v, atol=1e-5, rtol=0)


def test_a_hadamard_spreads_one_coordinate_over_all():
    r = randomized_hadamard(64)
    assert torch.allclose(r.abs(), torch.full((64, 64), 64 ** -0.5))


def test_rotated_int2_values_reconstruct_an_outlier_channel_better():
    """The reason for the rotation: one large channel stretches a token's four levels."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(256, 3, 64, generator=g)
    v[..., 5] *= 20
    rotation = KvRotation(64, "cpu")

    def int2(x: torch.Tensor) -> torch.Tensor:
        return dequantize_values(*quantize_value_rows(x, 2), 2, torch.float32)

    plain = (int2(v) - v).square().mean()
    rotated = (rotation.restore(int2(rotation.rotate(v))) - v).square().mean()
    assert rotated < 0.5 * plain


@pytest.mark.parametrize("kv_dtype,values,keys", [("int2", True, False), ("k3v2", True, False), ("k4v2", True, True),
                                                  ("int4", False, True), ("bf16", False, False)])
def test_2_bit_values_and_4_bit_keys_are_rotated(kv_dtype: str, values: bool, keys: bool):
    layout = AttentionLayout.from_config(CONFIG)
    cache = KVCache(KVCacheSpec.from_layout(layout, kv_dtype, block_size=4), (4,), residual_blocks=2)
    assert (cache.value_rotation(0) is not None, cache.key_rotation(0) is not None) == (values, keys)


def test_rotated_queries_and_keys_keep_their_scores():
    rotation = KvRotation(64, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 64, generator=g), torch.randn(7, 64, generator=g)
    torch.testing.assert_close(rotation.rotate(q) @ rotation.rotate(k).T, q @ k.T, atol=1e-4, rtol=0)
