import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.kv_sharing import _best_groups, kv_groups
from attention_variants.projections import proj_key
from foundation.attention_layout import KV_SOURCE_KEY
from tests.attention_variants.helpers import (
    config_of,
    convert_tiny,
    edit_checkpoint,
    logits,
)

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))


def _pairs_see_the_same_kv(weights):
    """Layers 1 and 3 get exactly the K/V of layers 0 and 2: the suppliers add nothing to the
    residual stream (o_proj and down_proj zero) and the pairs share norms and k/v projections."""
    for supplier, reader in ((0, 1), (2, 3)):
        weights[proj_key(supplier, "o_proj")].zero_()
        weights[f"model.layers.{supplier}.mlp.down_proj.weight"].zero_()
        norm = "model.layers.{}.input_layernorm.weight"
        weights[norm.format(reader)] = weights[norm.format(supplier)].clone()
        for proj in ("k_proj", "v_proj"):
            weights[proj_key(reader, proj)] = weights[proj_key(supplier, proj)].clone()
        k_norm = "model.layers.{}.self_attn.k_norm.weight"  # Qwen3
        if k_norm.format(reader) in weights:
            weights[k_norm.format(reader)] = weights[k_norm.format(supplier)].clone()


@pytest.mark.parametrize("arch,merge", [("llama", "mean"), ("llama", "calib"), ("qwen3", "calib")])
def test_paired_layers_with_identical_kv_share_with_unchanged_logits(tiny_checkpoints, tmp_path, arch, merge):
    src = edit_checkpoint(tiny_checkpoints[arch], tmp_path / "pairs", _pairs_see_the_same_kv)
    out = convert_tiny(src, tmp_path / "shared", ConvertSpec(kv_share=2, merge=merge), calibrate=merge == "calib")
    config = config_of(out)
    assert config[KV_SOURCE_KEY] == [0, 0, 2, 2]
    assert "auto_map" in config and (out / "modeling_kvslim.py").is_file()
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert proj_key(1, "k_proj") not in f.keys() and proj_key(0, "k_proj") in f.keys()
    torch.testing.assert_close(logits(out, IDS), logits(src, IDS), atol=2e-4, rtol=1e-4)


def test_cached_generation_matches_full_forward(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "shared", ConvertSpec(kv_share=2, kv_heads=1, merge="mean",
                                                                   sliding_window=8, global_every=2))
    from attention_variants.summary import load_for_eval

    model = load_for_eval(out)
    gen = model.generate(IDS[:, :12], max_new_tokens=10, do_sample=False)
    full = model(gen, use_cache=False).logits
    assert torch.equal(full[0, 11:-1].argmax(-1), gen[0, 12:])


def test_calibrated_grouping_keeps_the_owner_count(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "sel", ConvertSpec(kv_share=2, kv_share_select="calib"), calibrate=True)
    sources = config_of(out)[KV_SOURCE_KEY]
    assert sources[0] == 0 and len(set(sources)) == 2
    assert all(0 <= i - s < 2 for i, s in enumerate(sources))


def test_best_groups_finds_the_cheap_partition():
    # 5 layers in 3 groups of <= 2: reading across 1->2 and 3->4 is cheap, everything else costly.
    cost = {(r, s): 1.0 for r in range(5) for s in range(max(0, r - 1), r)}
    cost[(2, 1)] = cost[(4, 3)] = 0.0
    assert _best_groups(5, 2, 3, cost) == [[0], [1, 2], [3, 4]]
    assert kv_groups(5, 2) == [[0, 1], [2, 3], [4]]
