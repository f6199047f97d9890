"""The runtime's logits equal transformers' on the same checkpoint (tiny random fp32 models).

Tolerance (fixed up front): max |logit difference| <= 1e-4 in fp32 (logits are O(1-10); the two
implementations differ only in summation order). Every case runs the sequence both as one
prefill and as prefill + chunk + single-token decode steps through the engine's paged KV cache.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attention_variants.convert import ConvertSpec, convert
from runtime.model.loader import load_model
from tests.runtime.hf_oracle import hf_logits, hf_model, runtime_logits, single_thread  # noqa: F401
from tests.tiny_models import ARCHITECTURES, make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4
SEQ = 40
SPLITS = (17, 29)  # prefill 17, then a chunk of 12 (mask with an offset), then 11 decode steps


def _ids(vocab: int = 512, n: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def assert_matches_hf(path, ours: bool = False, ids: torch.Tensor | None = None) -> None:
    ids = _ids() if ids is None else ids
    ref = hf_logits(hf_model(path, ours=ours), ids)
    model = load_model(path)
    for splits in ((), SPLITS):
        got = runtime_logits(model, ids, splits)
        diff = (got - ref).abs().max().item()
        assert diff <= ATOL, f"{path.name} splits={splits}: max |diff| {diff:.2e} > {ATOL}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_matches_hf(tiny_checkpoints, arch):
    assert_matches_hf(tiny_checkpoints[arch])


VARIANTS = {
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "llama_mha_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama_rope_llama3": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama_rope_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "qwen2_yarn": ("qwen2", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128))),
    "qwen3_bias_mqa": ("qwen3", dict(attention_bias=True, num_key_value_heads=1)),
    "mistral_window8": ("mistral", dict(sliding_window=8)),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "qwen3_sliding": ("qwen3", dict(
        layer_types=["full_attention", "sliding_attention"] * 2, use_sliding_window=True, sliding_window=6)),
    "gemma3_window8_softcap": ("gemma3_text", dict(sliding_window=8, final_logit_softcapping=5.0)),
    "gemma3_gqa_untied": ("gemma3_text", dict(num_key_value_heads=2, tie_word_embeddings=False, query_pre_attn_scalar=48)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_hf(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(tmp_path / variant, arch, **overrides)
    assert_matches_hf(path)


CONVERSIONS = {
    "share2": ConvertSpec(kv_share=2, merge="mean"),
    "share2_hybrid": ConvertSpec(kv_share=2, merge="mean", sliding_window=8, global_every=4),
    "hybrid": ConvertSpec(sliding_window=8, global_every=2),
    "hybrid_sinks": ConvertSpec(sliding_window=8, global_every=2, sinks=3),
    "share2_hybrid_sinks": ConvertSpec(kv_share=2, merge="mean", sliding_window=6, global_every=4, sinks=5),
    # per layer: none, the second, both, the first KV head stream (split layers in both head orders)
    "streaming_heads": ConvertSpec(sliding_window=8, sinks=3, streaming_set=((), (1,), (0, 1), (0,))),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
def test_converted_checkpoints_match_their_modeling_file(tiny_checkpoints, tmp_path, arch, conversion):
    """`compress convert` output (KV sharing, hybrid sliding window, sinks) against the modeling
    file it carries."""
    out = convert(tiny_checkpoints[arch], CONVERSIONS[conversion], tmp_path / "converted").out
    config = json.loads((out / "config.json").read_text())
    if CONVERSIONS[conversion].kv_share:
        assert config["kv_source_layers"] != list(range(4))
    assert_matches_hf(out, ours="auto_map" in config)


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sinks_on_a_native_sliding_model_match_the_modeling_file(tmp_path, arch):
    """A model's own window (Mistral: every layer; Gemma 3: 5 in 6, with its own local rope)
    gains sinks; the checkpoint then carries our file, and the sinks change the logits."""
    src = make_tiny_checkpoint(tmp_path / "w8", arch, sliding_window=8)
    out = convert(src, ConvertSpec(sinks=3), tmp_path / "sinks").out
    config = json.loads((out / "config.json").read_text())
    assert config["num_sink_tokens"] == 3 and "auto_map" in config
    assert_matches_hf(out, ours=True)
    ids = _ids()
    assert not torch.allclose(hf_logits(hf_model(out, ours=True), ids), hf_logits(hf_model(src), ids), atol=1e-3)


def test_gemma_streaming_heads_on_its_full_layers_match_the_modeling_file(tmp_path):
    """Gemma 3 (own sliding layers, two ropes): streaming heads on its full layers, one split and
    one whole, with sinks for the streaming heads only; the runtime equals our modeling file."""
    src = make_tiny_checkpoint(tmp_path / "g", "gemma3_text", sliding_window=8, num_key_value_heads=2,
                               layer_types=["sliding_attention", "full_attention"] * 2)
    spec = ConvertSpec(sliding_window=6, sinks=2, streaming_set=((), (1,), (), (0, 1)))
    out = convert(src, spec, tmp_path / "streaming").out
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window"] == 8 and "num_sink_tokens" not in config and "auto_map" in config
    assert_matches_hf(out, ours=True)
    ids = _ids()
    assert not torch.allclose(hf_logits(hf_model(out, ours=True), ids), hf_logits(hf_model(src), ids), atol=1e-3)


def test_converted_mqa_matches_hf(tiny_checkpoints, tmp_path):
    out = convert(tiny_checkpoints["mistral"], ConvertSpec(kv_heads=1, merge="mean"), tmp_path / "mqa").out
    assert_matches_hf(out)


def test_gemma_kv_sharing_matches_hf_with_substituted_kv(tmp_path):
    """No modeling file covers Gemma 3: the oracle is transformers' Gemma 3 whose reader layers'
    k_proj / v_proj outputs are replaced by their source layer's (same k_norm weights, same
    rope because the layer kinds match), which is exactly what sharing the cache means."""
    sources = [0, 0, 0, 3]
    full = make_tiny_checkpoint(tmp_path / "full", "gemma3_text", kv_source_layers=sources, sliding_window=8)
    weights = load_file(full / "model.safetensors")
    for j, src in enumerate(sources):
        if src != j:
            weights[f"model.layers.{j}.self_attn.k_norm.weight"] = weights[f"model.layers.{src}.self_attn.k_norm.weight"].clone()
    save_file(weights, str(full / "model.safetensors"), metadata={"format": "pt"})
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "config.json").write_text((full / "config.json").read_text())
    readers = [f"model.layers.{j}.self_attn.{m}.weight" for j, s in enumerate(sources) if s != j
               for m in ("k_proj", "v_proj", "k_norm")]
    save_file({k: v for k, v in weights.items() if k not in readers}, str(shared / "model.safetensors"),
              metadata={"format": "pt"})

    hf = hf_model(full)
    captured: dict[str, torch.Tensor] = {}
    for j, src in enumerate(sources):
        for proj in ("k_proj", "v_proj"):
            module = getattr(hf.model.layers[j].self_attn, proj)
            if src == j:
                module.register_forward_hook(lambda m, i, o, key=(j, proj): captured.__setitem__(key, o))
            else:
                module.register_forward_hook(lambda m, i, o, key=(src, proj): captured[key])
    ids = _ids()
    ref = hf_logits(hf, ids)
    model = load_model(shared)
    for splits in ((), SPLITS):
        diff = (runtime_logits(model, ids, splits) - ref).abs().max().item()
        assert diff <= ATOL, f"splits={splits}: {diff:.2e}"
    # and sharing does change the model: the unshared checkpoint differs
    assert (hf_logits(hf_model(full), ids) - ref).abs().max().item() > 1e-2


def test_bf16_close_to_hf_bf16(tiny_checkpoints):
    """bf16 activations: within bf16 rounding of transformers in bf16 (atol 0.1 on O(4) logits)."""
    path = tiny_checkpoints["llama"]
    ids = _ids()
    ref = hf_logits(hf_model(path, torch.bfloat16), ids)
    got = runtime_logits(load_model(path, "bfloat16"), ids, SPLITS)
    assert (got - ref).abs().max().item() <= 0.1
