import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.projections import proj_key
from tests.attention_variants.helpers import (
    config_of,
    convert_tiny,
    edit_checkpoint,
    logits,
)

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))


def _duplicate_kv_heads(weights):
    """Make each layer's second KV head a copy of the first (2 KV heads x head_dim 32)."""
    for layer in range(4):
        for proj in ("k_proj", "v_proj"):
            w = weights[proj_key(layer, proj)]
            w[32:64] = w[0:32]


@pytest.mark.parametrize("merge", ["mean", "calib"])
def test_identical_kv_heads_merge_to_mqa_with_unchanged_logits(tiny_llama, tmp_path, merge):
    src = edit_checkpoint(tiny_llama, tmp_path / "dup", _duplicate_kv_heads)
    out = convert_tiny(src, tmp_path / "mqa", ConvertSpec(kv_heads=1, merge=merge), calibrate=merge == "calib")
    assert config_of(out)["num_key_value_heads"] == 1
    assert "auto_map" not in config_of(out)  # plain transformers expresses MQA natively
    torch.testing.assert_close(logits(out, IDS), logits(src, IDS), atol=2e-4, rtol=1e-4)


def test_calibrated_merge_beats_mean_pool_on_distinct_heads(tiny_llama, tmp_path):
    ref = logits(tiny_llama, IDS)
    mean = convert_tiny(tiny_llama, tmp_path / "mean", ConvertSpec(kv_heads=1, merge="mean"))
    calib = convert_tiny(tiny_llama, tmp_path / "calib", ConvertSpec(kv_heads=1, merge="calib"), calibrate=True)
    err_mean = (logits(mean, IDS) - ref).pow(2).mean()
    err_calib = (logits(calib, IDS) - ref).pow(2).mean()
    assert err_calib < err_mean


def test_qwen2_biases_merge_exactly_for_identical_heads(tiny_checkpoints, tmp_path):
    def dup(weights):
        for layer in range(4):
            for proj in ("k_proj", "v_proj"):
                for param in ("weight", "bias"):
                    t = weights[proj_key(layer, proj, param)]
                    t[32:64] = t[0:32]

    src = edit_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "dup", dup)
    out = convert_tiny(src, tmp_path / "mqa", ConvertSpec(kv_heads=1, merge="calib"), calibrate=True)
    torch.testing.assert_close(logits(out, IDS), logits(src, IDS), atol=2e-4, rtol=1e-4)
