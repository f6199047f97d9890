"""The shared KV-bytes formula against the caches transformers actually allocates."""
import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.summary import load_for_eval
from foundation.attention_layout import AttentionLayout
from tests.attention_variants.helpers import config_of, convert_tiny

SPECS = {
    "original": None,
    "mqa": ConvertSpec(kv_heads=1, merge="mean"),
    "share2": ConvertSpec(kv_share=2, merge="mean"),
    "hybrid": ConvertSpec(sliding_window=16, global_every=2),
    "all": ConvertSpec(kv_heads=1, kv_share=2, sliding_window=16, global_every=4, merge="mean"),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_formula_matches_dynamic_cache_bytes(tiny_llama, tmp_path, name):
    path = tiny_llama if SPECS[name] is None else convert_tiny(tiny_llama, tmp_path / name, SPECS[name])
    layout = AttentionLayout.from_config(config_of(path))
    model = load_for_eval(path)
    tokens = 40
    with torch.no_grad():
        cache = model(torch.randint(0, 512, (1, tokens)), use_cache=True).past_key_values
    allocated = sum(
        l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
        for l in cache.layers if l.is_initialized
    )
    # transformers keeps W - 1 tokens of a sliding layer between steps (the next token makes W);
    # the formula counts the W a step attends over.
    one_token = 2 * layout.num_kv_heads * layout.head_dim * 4
    sliding_owners = [i for i in layout.cache_owners() if layout.layers[i].kind == "sliding"]
    assert layout.kv_bytes(tokens, dtype_bytes=4) == allocated + one_token * len(sliding_owners)
