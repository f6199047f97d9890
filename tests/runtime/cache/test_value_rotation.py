"""The rotated basis int2 values are kept in: orthonormal, spreading, and what the cache uses."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.low_bit_kv import dequantize_values, quantize_value_rows
from runtime.cache.value_rotation import ValueRotation, randomized_hadamard

CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "hidden_size": 32, "layer_types": ["full_attention"], "kv_source_layers": [0]}


@pytest.mark.parametrize("d", [8, 64, 80])
def test_the_rotation_is_orthonormal_and_restores(d: int):
    r = randomized_hadamard(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
    rotation = ValueRotation(d, "cpu")
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
    rotation = ValueRotation(64, "cpu")

    def int2(x: torch.Tensor) -> torch.Tensor:
        return dequantize_values(*quantize_value_rows(x, 2), 2, torch.float32)

    plain = (int2(v) - v).square().mean()
    rotated = (rotation.restore(int2(rotation.rotate(v))) - v).square().mean()
    assert rotated < 0.5 * plain


@pytest.mark.parametrize("kv_dtype,rotated", [("int2", True), ("int4", False), ("bf16", False)])
def test_only_int2_caches_rotate_values(kv_dtype: str, rotated: bool):
    layout = AttentionLayout.from_config(CONFIG)
    cache = KVCache(KVCacheSpec.from_layout(layout, kv_dtype, block_size=4), (4,), residual_blocks=2)
    assert (cache.value_rotation(0) is not None) is rotated
