"""Attention backends chosen by name: the engine serves the same tokens through each."""
import pytest

from foundation.errors import KvslimError
from runtime.attention.paged import PagedAttentionBackend
from runtime.attention.registry import ATTENTION_BACKENDS, make_attention_backend
from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model

PROMPTS = [[5, 17, 42, 99, 3, 8], list(range(10, 40))]


def test_unknown_backend_is_one_line():
    with pytest.raises(KvslimError, match="attention backend 'flash' is not known .*torch, triton"):
        make_attention_backend("flash", None, [])


@pytest.mark.parametrize("name,cls", [("torch", PagedAttentionBackend), ("triton", KernelAttentionBackend)])
def test_engine_serves_the_same_tokens_through_each_backend(tiny_llama, name, cls):
    assert set(ATTENTION_BACKENDS) == {"torch", "triton"}
    model = load_model(tiny_llama, "float32")
    config = dict(block_size=4, max_num_batched_tokens=16, max_model_len=64, kv_cache_bytes=1 << 20)
    engine = Engine(model, EngineConfig(attention_backend=name, **config))
    assert isinstance(engine.backend, cls)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = Engine(model, EngineConfig(**config)).generate(PROMPTS, params)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in reference]
