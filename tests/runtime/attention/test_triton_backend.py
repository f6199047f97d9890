"""The kernel backend against the engine's torch backend, over the engine's own cache, block
manager (window release, shared-KV layers) and batches: chunked prefill and decode steps."""
import random

import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.attention.backend import AttentionParams
from runtime.attention.key_rope import KeyRope
from runtime.attention.paged import PagedAttentionBackend, PagedBatch
from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.engine.block_manager import BlockManager, PrefixHit
from runtime.model.spec import RopeSpec

WINDOW = 5
CONFIG = dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16,
    sliding_window=WINDOW,
    layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    kv_source_layers=[0, 1, 0, 3],
)


def make_backends(kv_dtype, static, softcap, use_triton, device, sinks=0):
    layout = AttentionLayout.from_config({**CONFIG, "num_sink_tokens": sinks})
    spec = KVCacheSpec.from_layout(layout, kv_dtype, block_size=4, static_scales=static)
    scales = {i: (0.05, 0.04) for i in layout.cache_owners()} if static else None
    # Keys arrive before rotary: both backends rotate them (int2 on read, the rest before the store).
    rope = KeyRope.of(RopeSpec("default", 100.0), 16, 512)
    params = [AttentionParams(0.3, l.window, l.kv_source, softcap, l.sinks, rope) for l in layout.layers]
    res = 8  # int4/int2 residual blocks: 3 sequences, at most 2 open blocks each while a chunk is written
    ours = KernelAttentionBackend(KVCache(spec, (32, 32), device=device, layer_scales=scales, residual_blocks=res),
                                  params, use_triton)
    theirs = PagedAttentionBackend(KVCache(spec, (32, 32), layer_scales=scales, residual_blocks=res), params)
    return layout, ours, theirs


@pytest.mark.parametrize("kv_dtype,static,softcap,sinks", [
    ("fp32", False, 5.0, 0), ("int8", False, None, 0), ("int8", True, None, 0), ("int4", False, None, 0),
    ("int2", False, 5.0, 0), ("fp32", False, None, 2), ("int4", False, None, 5), ("int2", False, None, 5),
    # KV dtypes per cache group: full layers in one, sliding layers in another
    ("int8/int4", False, None, 0), ("fp32/int2", False, None, 5), ("int4/int8", False, 5.0, 2)])
def test_kernel_backend_matches_the_engine_backend(device, kv_dtype, static, softcap, sinks):
    torch.manual_seed(0)
    rng = random.Random(0)
    layout, ours, theirs = make_backends(kv_dtype, static, softcap, use_triton=True, device=device, sinks=sinks)
    bm = BlockManager((32, 32), 4, (None, WINDOW), enable_prefix_caching=False, sinks=(0, sinks))
    targets, computed = {0: 14, 1: 2, 2: 11}, {0: 0, 1: 0, 2: 0}  # crosses blocks, the window and the sinks
    while any(computed[s] < targets[s] for s in targets):
        active = [s for s in targets if computed[s] < targets[s]]
        firsts, lens, tables = [], [], []
        for s in active:
            n = min(targets[s] - computed[s], rng.choice([1, 4]))
            if s not in bm.tables:
                assert bm.allocate(s, PrefixHit(0, ((), ()), ()), n)
            else:
                bm.release_window(s, computed[s])
                assert bm.append(s, computed[s], computed[s] + n)
            firsts.append(computed[s])
            lens.append(n)
            tables.append(bm.block_tables(s))
        ours.set_batch(PagedBatch.build(4, firsts, lens, tables, device=device))
        theirs.set_batch(PagedBatch.build(4, firsts, lens, tables))
        T = sum(lens)
        for layer, la in enumerate(layout.layers):
            q = torch.randn(T, 4, 16)
            owner = la.kv_source == layer
            k, v = (torch.randn(T, 2, 16), torch.randn(T, 2, 16)) if owner else (None, None)
            to = lambda t: None if t is None else t.to(device)
            got = ours.attend(layer, to(q), to(k), to(v)).cpu()
            want = theirs.attend(layer, q, k, v)
            # (fp8 KV is left to test_paged_attention / test_kv_store: the interpreter's fp32 -> fp8
            # cast is off by a binade on some values, which no fixed tolerance here would mean much)
            tol = 1e-2 if device.type == "cuda" else 1e-4  # tf32 dots on GPU
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for s, n in zip(active, lens):
            computed[s] += n


def test_reference_routing_on_cpu():
    layout, ours, theirs = make_backends("int8", False, None, use_triton=None, device="cpu")
    batch = PagedBatch.build(4, [0], [3], [((0,), (1,))])
    ours.set_batch(batch)
    theirs.set_batch(batch)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    torch.testing.assert_close(ours.attend(0, q, k, v), theirs.attend(0, q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_inputs_are_checked_once_where_built_not_per_layer(monkeypatch, kv_dtype):
    """The caches are checked when the backend is built and the batch once per step: a bad batch is
    one line at ``set_batch``, and ``attend`` runs no input check of its own."""
    from foundation.errors import KvslimError
    from runtime.kernels import packed_paged_attention as ppa
    from runtime.kernels import paged_attention as pa

    _, ours, _ = make_backends(kv_dtype, False, None, use_triton=False, device="cpu")
    bad = PagedBatch.build(4, [0], [3], [((0,), (1,))])
    bad = PagedBatch(**{**bad.__dict__, "context_lens": bad.context_lens.long()})
    with pytest.raises(KvslimError, match="context_lens must be int32"):
        ours.set_batch(bad)
    ours.set_batch(PagedBatch.build(4, [0], [3], [((0,), (1,))]))

    def checked(*args, **kwargs):
        raise AssertionError("checked per call")

    monkeypatch.setattr(pa, "_check_inputs", checked)
    monkeypatch.setattr(ppa, "_check_inputs", checked)
    q, k, v = torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    assert ours.attend(0, q, k, v).shape == q.shape


def test_a_cache_the_kernels_cannot_index_is_refused_when_the_backend_is_built():
    from foundation.errors import KvslimError

    _, ours, _ = make_backends("int8", False, None, use_triton=False, device="cpu")
    ours.cache.layers[0].v_scale = None
    with pytest.raises(KvslimError, match="needs k_scale and v_scale"):
        KernelAttentionBackend(ours.cache, ours.params, use_triton=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine keeps its cache on the CPU; this drives the kernels through the interpreter")
@pytest.mark.parametrize("arch,kv_dtype,overrides", [
    ("gemma3_text", "int8", {}),  # sliding + full layers, softcap-free
    ("llama", "int8", {"streaming_heads": {"window": 6, "sinks": 2, "kv_heads": [[], [1], [0, 1], [0]]}}),
])
def test_engine_generates_the_same_through_the_kernels(tmp_path, arch, kv_dtype, overrides):
    """The engine end to end with its attention swapped for the Triton kernels (the interpreter
    on CPU): same greedy tokens and logprobs as with its own torch backend; with streaming heads,
    split layers attend per cache entry."""
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams
    from runtime.model.loader import load_model
    from tests.tiny_models import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / arch, arch, **overrides), "float32")
    cfg = EngineConfig(kv_dtype=kv_dtype, block_size=4, max_num_batched_tokens=32, max_model_len=64, kv_cache_bytes=1 << 20)
    prompts = [list(range(5, 17)), list(range(40, 45))]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    want = Engine(model, cfg).generate(prompts, params)
    engine = Engine(model, cfg)
    engine.backend = KernelAttentionBackend(engine.cache, engine.backend.params, use_triton=True)
    got = engine.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4


def test_the_write_plan_is_made_from_the_host_slots():
    """The step's plan (asked once per group by ``set_batch``: ``test_residual_slots``) comes from
    the batch's host copy of its slots and equals the plan of the slots themselves."""
    from runtime.cache.write_plan import WritePlan

    batch = PagedBatch.build(4, [0, 6], [5, 3], [((0, 1), (2,)), ((3, 4, 7), (5, 6, 8))])
    plan = batch.write_plan(0)
    assert batch.slot_mapping_host[0].device.type == "cpu"
    again = WritePlan.of(batch.slot_mapping[0], 4)
    assert (plan.full_blocks, plan.open_blocks) == (again.full_blocks, again.open_blocks) == ((0, 4), (1, 7))
    assert torch.equal(plan.src, again.src) and torch.equal(plan.stays, again.stays)
