"""AttentionLayout <-> config keys, and the KV-bytes formula against caches transformers allocates."""
import pytest
import torch

from foundation.attention_layout import KV_SOURCE_KEY, AttentionLayout
from foundation.errors import KvslimError
from tests.tiny_models import tiny_config


def test_plain_llama_layout():
    cfg = tiny_config("llama").to_dict()
    layout = AttentionLayout.from_config(cfg)
    assert layout.num_layers == 4 and layout.num_kv_heads == 2 and layout.head_dim == 32
    assert layout.cache_owners() == [0, 1, 2, 3] and layout.sliding_layers() == []
    # 4 layers * 2 (k, v) * 2 heads * 32 dims * 2 bytes
    assert layout.kv_bytes_per_token(1000, 2) == 4 * 2 * 2 * 32 * 2
    assert layout.config_updates() == {"num_key_value_heads": 2}


def test_hybrid_and_shared_layout_round_trips_through_config():
    cfg = tiny_config("gemma3_text").to_dict()
    cfg[KV_SOURCE_KEY] = [0, 0, 2, 3]
    layout = AttentionLayout.from_config(cfg)
    assert layout.sliding_layers() == [0, 1, 2] and layout.layers[0].window == 16
    assert layout.cache_owners() == [0, 2, 3]
    again = AttentionLayout.from_config({**cfg, **layout.config_updates()})
    assert again == layout
    # owners: two sliding layers capped at 16 tokens, one full layer; 1 KV head of 32 dims, bf16
    per_tok_full = 2 * 1 * 32 * 2
    assert layout.kv_bytes(100, 2) == per_tok_full * (16 + 16 + 100)
    assert layout.kv_bytes(10, 2) == per_tok_full * 30


def test_scale_bytes_are_per_token_and_head():
    layout = AttentionLayout.from_config(tiny_config("llama").to_dict())
    assert layout.kv_bytes_per_token(64, 1, scale_bytes=4) == 4 * 2 * 2 * (32 + 4)


@pytest.mark.parametrize(
    "sources, message",
    [([0, 0, 1, 3], "owns its cache"), ([1, 1, 2, 3], "earlier layer"), ([0, 0, 2], "3 entries")],
)
def test_bad_kv_sources_are_rejected(sources, message):
    cfg = {**tiny_config("llama").to_dict(), KV_SOURCE_KEY: sources}
    with pytest.raises(KvslimError, match=message):
        AttentionLayout.from_config(cfg)


def test_sharing_across_different_windows_is_rejected():
    cfg = {**tiny_config("gemma3_text").to_dict(), KV_SOURCE_KEY: [0, 1, 2, 2]}
    with pytest.raises(KvslimError, match="windows differ"):
        AttentionLayout.from_config(cfg)


def _hf_cache_bytes(config, seq_len: int) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    total = 0
    for layer in cache.layers:
        total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text", "mistral"])
@pytest.mark.parametrize("seq_len", [8, 100])
def test_formula_matches_the_cache_transformers_allocates(model_type, seq_len):
    config = tiny_config(model_type)
    layout = AttentionLayout.from_config(config.to_dict())
    hf = _hf_cache_bytes(config, seq_len)
    ours = layout.kv_bytes(seq_len, dtype_bytes=2)
    # transformers keeps window - 1 tokens of a sliding layer between steps (the next query is the
    # W-th); our formula counts the W tokens attended during a step. Account for that difference.
    sliding_owners = [i for i in layout.cache_owners() if layout.layers[i].kind == "sliding"]
    capped = sum(1 for i in sliding_owners if seq_len >= layout.layers[i].window)
    per_token_layer = 2 * layout.num_kv_heads * layout.head_dim * 2
    assert hf == ours - capped * per_token_layer
