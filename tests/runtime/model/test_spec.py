"""ModelSpec from config.json: family switches, rope forms, and one-line refusals."""
from __future__ import annotations

import json

import pytest

from foundation.errors import KvslimError, UnsupportedArchitecture
from runtime.model.spec import ModelSpec


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_family_switches(tiny_checkpoints):
    specs = {a: ModelSpec.from_config(_config(p)) for a, p in tiny_checkpoints.items()}
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].o_bias
    assert specs["qwen3"].qk_norm and not specs["llama"].qk_norm
    assert all(s.attention.layers[0].kind == "sliding" for s in [specs["mistral"]])
    g = specs["gemma3_text"]
    assert g.norm_offset == 1.0 and g.sandwich_norm and g.embed_scale == pytest.approx(128**0.5)
    assert g.attn_scale == pytest.approx(32**-0.5) and g.hidden_act == "gelu_pytorch_tanh"
    assert [l.kind for l in g.attention.layers] == ["sliding"] * 3 + ["full"]
    assert [r.theta for r in g.rope] == [10_000.0] * 3 + [1_000_000.0]
    assert g.tie_word_embeddings and g.num_kv_heads(0) == 1


def test_legacy_rope_keys_and_gemma_pattern(tiny_checkpoints):
    cfg = _config(tiny_checkpoints["llama"])
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    rope = ModelSpec.from_config(cfg).rope[0]
    assert (rope.rope_type, rope.theta, dict(rope.params)) == ("linear", 5e5, {"factor": 2.0})
    g = _config(tiny_checkpoints["gemma3_text"])
    for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        g.pop(k)
    g.update(num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    spec = ModelSpec.from_config(g)
    assert [i for i, l in enumerate(spec.attention.layers) if l.kind == "full"] == [5, 11]
    assert spec.rope[5].theta == 1e6 and spec.rope[0].theta == 1e4


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"hidden_act": "relu"}, "activation 'relu'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method='gptq'"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}},
     "static activation scales"),
    ({"kv_source_layers": [0, 0, 5, 3]}, "kv_source_layers"),
])
def test_unservable_configs_raise_one_line(tiny_checkpoints, change, message):
    cfg = {**_config(tiny_checkpoints["llama"]), **change}
    with pytest.raises(KvslimError, match=message) as err:
        ModelSpec.from_config(cfg)
    assert "\n" not in str(err.value)
    if "model_type" in change:
        assert isinstance(err.value, UnsupportedArchitecture)


def test_missing_config_key_is_a_checkpoint_error(tiny_checkpoints):
    cfg = _config(tiny_checkpoints["llama"])
    del cfg["vocab_size"]
    with pytest.raises(KvslimError, match="vocab_size"):
        ModelSpec.from_config(cfg)


def test_quant_spec_targets_and_ignore(tiny_checkpoints):
    cfg = _config(tiny_checkpoints["llama"])
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*down_proj$"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}}},
    }
    quant = ModelSpec.from_config(cfg).quant
    assert quant.scheme_for("model.layers.0.mlp.up_proj").num_bits == 4
    assert quant.scheme_for("model.layers.0.mlp.down_proj") is None
    assert quant.scheme_for("lm_head") is None
