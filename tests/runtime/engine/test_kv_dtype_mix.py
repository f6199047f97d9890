"""KV dtypes per cache group (``FULL/WINDOWED``): each group allocated, stored and read in its own
dtype, the bytes counted per group, and a mix equal to one dtype where the layout has one kind."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from foundation.errors import KvslimError
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.packed_layer import PackedLayerCache
from runtime.engine.engine import Engine, EngineConfig
from runtime.model.loader import load_model
from tests.runtime.engine.test_engine_tiny import prompts

STREAMING = dict(sliding_window=8, sinks=5, streaming_set=((), (1,), (0, 1), (0,)))
CFG = dict(block_size=4, max_num_batched_tokens=32, max_model_len=128, kv_cache_bytes=2 << 20)


@pytest.fixture(scope="module")
def streaming_model(tiny_llama, tmp_path_factory):
    from attention_variants.convert import ConvertSpec, convert

    path = convert(tiny_llama, ConvertSpec(**STREAMING), tmp_path_factory.mktemp("mix") / "streaming").out
    return load_model(path, "float32")


def test_each_group_is_allocated_in_its_own_dtype(streaming_model):
    layout = streaming_model.spec.attention
    spec = KVCacheSpec.from_layout(layout, "int8/int4", block_size=4)
    assert {(g.kind, g.kv_dtype) for g in spec.groups} == {("full", "int8"), ("sliding", "int4")}
    cache = KVCache(spec, (8,) * len(spec.groups), residual_blocks=2)
    for entry, (g, _) in enumerate(spec.layer_slots):
        packed = isinstance(cache.layers[entry], PackedLayerCache)
        assert packed == (spec.groups[g].kind == "sliding")
        if not packed:
            assert cache.layers[entry].k_cache.dtype == torch.int8
    # bytes per token: each group at its own dtype, summed
    ctx = 100
    per_group = [KVCacheSpec.from_layout(layout, d, block_size=4) for d in ("int8", "int4")]
    by_kind = {kind: sum(layout.kv_bytes_per_token(ctx, s.element_bytes(g), s.scale_bytes(grp), list(grp.layers))
                         for g, grp in enumerate(s.groups) if grp.kind == kind)
               for kind, s in (("full", per_group[0]), ("sliding", per_group[1]))}
    assert spec.kv_bytes_per_token(layout, ctx) == pytest.approx(by_kind["full"] + by_kind["sliding"])
    assert per_group[1].kv_bytes_per_token(layout, ctx) < spec.kv_bytes_per_token(layout, ctx) \
        < per_group[0].kv_bytes_per_token(layout, ctx)


@pytest.mark.parametrize("name", ["int8/int9", "int8/int4/int2", "", "int8/"])
def test_a_bad_mix_is_one_line(streaming_model, name):
    with pytest.raises(KvslimError, match="unknown KV dtype"):
        KVCacheSpec.from_layout(streaming_model.spec.attention, name)


def test_static_scales_refuse_a_mix():
    layout = AttentionLayout.from_config(dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              hidden_size=64, head_dim=16))
    with pytest.raises(KvslimError, match="one quantized KV dtype"):
        KVCacheSpec.from_layout(layout, "int8/fp8_e4m3", static_scales=True)


def test_a_mix_over_one_kind_is_that_dtype(tiny_llama):
    """Without windowed entries ``int8/int2`` stores everything in int8: the same logits."""
    model = load_model(tiny_llama, "float32")
    ids = prompts(1, seed=4, lo=60, hi=61)[0]
    mixed = Engine(model, EngineConfig(kv_dtype="int8/int2", **CFG))
    assert {g.kv_dtype for g in mixed.kv_spec.groups} == {"int8"}
    torch.testing.assert_close(mixed.score(ids), Engine(model, EngineConfig(kv_dtype="int8", **CFG)).score(ids),
                               rtol=0, atol=0)


def test_each_groups_dtype_changes_only_its_own_reads(streaming_model):
    """``fp32/int8`` (windowed KV quantized) and ``int8/fp32`` (full KV quantized) each differ from
    fp32 and from uniform int8, and stay as close to fp32 as uniform int8 does."""
    ids = prompts(1, seed=5, lo=90, hi=91)[0]

    def logprobs(kv_dtype: str) -> torch.Tensor:
        engine = Engine(streaming_model, EngineConfig(kv_dtype=kv_dtype, **CFG))
        return torch.log_softmax(engine.score(ids), -1)

    ref, uniform = logprobs("fp32"), logprobs("int8")
    kl_uniform = (uniform.exp() * (uniform - ref)).sum(-1).mean()
    for mix in ("fp32/int8", "int8/fp32"):
        got = logprobs(mix)
        assert not torch.equal(got, ref) and not torch.equal(got, uniform)
        kl = (got.exp() * (got - ref)).sum(-1).mean()
        assert 0 < kl < 2 * kl_uniform + 1e-6


def test_generation_with_packed_windowed_kv(streaming_model):
    """``int8/int4``: full heads in int8, streaming heads packed at 4 bits; greedy decoding runs
    through both kinds of group (prefill, block fills, window release) and is repeatable."""
    from runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ps = prompts(3, seed=6, lo=20, hi=40)

    def run() -> list[list[int]]:
        engine = Engine(streaming_model, EngineConfig(kv_dtype="int8/int4", **CFG))
        ids = [engine.add_request(p, params) for p in ps]
        done = {}
        while engine.has_unfinished:
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    first = run()
    assert all(len(t) == 24 for t in first) and run() == first
