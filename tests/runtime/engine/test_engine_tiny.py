"""The engine under stress (small blocks, short chunks, prefix hits, preemption, sliding windows,
shared KV, batches) against the engine run plainly through ``LLM`` (one large chunk, 16-token
blocks, one request at a time), on tiny random models: the same tokens up to the first near-tie
and logprobs within tolerance. The plain run itself is checked against transformers' logits in
``tests/runtime/model/test_decoder_hf.py``."""
import pytest
import torch

from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.llm import LLM
from runtime.model.loader import load_model

LP_TOL = 1e-4  # fp32 both sides; only the summation order differs
TIE = 1e-3  # tokens may differ only where the core's top-2 logprobs are this close


def assert_same(engine_out, core_out, tol=LP_TOL, tie=TIE):
    comp = core_out.outputs[0]
    for t, (a, b) in enumerate(zip(engine_out.token_ids, comp.token_ids)):
        le, lc = engine_out.logprobs[t], comp.logprobs[t]
        top_core = dict(lc.top)
        for tok, lp in le.top:  # the engine's top-k, valued by the core at the same position
            if tok in top_core:
                assert abs(lp - top_core[tok]) < tol, (t, tok, lp, top_core[tok])
        if a != b:
            assert lc.top[0][1] - lc.top[1][1] < tie, f"tokens differ at {t} without a near-tie"
            return
    assert engine_out.token_ids == list(comp.token_ids)
    assert engine_out.finish_reason == comp.finish_reason


def prompts(n, seed=0, lo=1, hi=60, prefix=()):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [list(prefix) + torch.randint(3, 512, (k,), generator=g).tolist() for k in lens]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # full / sliding+full; the rest below
def test_batch_of_16_matches_core(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    core = LLM(path, max_model_len=128)
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=48, max_model_len=128,
                                             kv_cache_bytes=4 << 20))
    ps = prompts(16, seed=1, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    eng = engine.generate(ps, params)
    ref = core.generate(ps, params)
    for e, r in zip(eng, ref):
        assert_same(e, r)
    alone = engine.generate([ps[5]], params)[0]  # the same request alone
    assert_same(alone, ref[5])
    assert all(p.num_free == p.num_blocks for p in engine.block_manager.pools)


# W8A8's per-token INT8 activations put each token's most negative value on a rounding tie
# (compressed-tensors' scale is amax / 127.5), so 1e-7 summation-order differences can move it by
# one step; attention carries that to later positions. The bound is test_linear.py's whole-model
# W8A8 bound, 5% of the logit range (about 3.3 on the tiny llama); measured here: at most 0.044
# (logprob) over prompt seeds 1-3, one greedy divergence at a near-tie in 48 requests.
W8A8_LP_TOL = 0.15
W8A8_TIE = 0.15


def test_w8a8_model_matches_core(tiny_llama, tmp_path, monkeypatch):
    from compress.quantize import quantize_checkpoint
    from foundation.schemes import W8A8
    from runtime.model.layers.activation_dtype import CpuFeatures
    from runtime.model.layers.linear import W8A8Linear

    path = quantize_checkpoint(tiny_llama, tmp_path / "w8a8", W8A8, progress=False).out
    # A CPU with VNNI, so the engine runs torch._int_mm (conftest's CPU has none); fp32 activations.
    vnni = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=False, amx=False)
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: vnni))
    core = LLM(path, max_model_len=128)
    assert any(isinstance(m, W8A8Linear) and m.use_int_mm for m in core.model.modules())
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=48, max_model_len=128,
                                             kv_cache_bytes=4 << 20))
    ps = prompts(16, seed=1, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    for e, r in zip(engine.generate(ps, params), core.generate(ps, params)):
        assert_same(e, r, tol=W8A8_LP_TOL, tie=W8A8_TIE)


def test_kv_sharing_model_matches_core(kv_shared_checkpoint):
    core = LLM(kv_shared_checkpoint, max_model_len=128)
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=16, max_model_len=128,
                                             kv_cache_bytes=1 << 20))
    assert [len(g.layers) for g in engine.kv_spec.groups] == [1, 1]  # two owners, two windows
    ps = prompts(8, seed=2, hi=40)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    for e, r in zip(engine.generate(ps, params), core.generate(ps, params)):
        assert_same(e, r)


def test_sinks_model_matches_core_and_holds_only_sinks_and_window(tiny_llama, tmp_path):
    """Sliding layers with attention sinks: the same outputs as the plain run, and over a long
    generation each decoding sequence's sliding group never holds more than its sink blocks, its
    window's blocks and one block being filled (counted from the block tables after every step)."""
    from attention_variants.convert import ConvertSpec, convert

    path = convert(tiny_llama, ConvertSpec(sliding_window=8, global_layers=(3,), sinks=5), tmp_path / "sinks").out
    core = LLM(path, max_model_len=128)
    bs = 4
    engine = Engine(core.model, EngineConfig(block_size=bs, max_num_batched_tokens=12, max_model_len=128,
                                             kv_cache_bytes=1 << 20))
    sliding = [g for g, grp in enumerate(engine.kv_spec.groups) if grp.window is not None]
    assert [engine.kv_spec.groups[g].sinks for g in sliding] == [5]
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=3, ignore_eos=True)
    outs, most = generate_counting_blocks(engine, ps, params, sliding)
    assert 0 < most <= -(-5 // bs) + -(-(8 + bs - 1) // bs) + 1
    for o, r in zip(outs, core.generate(ps, params)):
        assert_same(o, r)


def generate_counting_blocks(engine, ps, params, groups) -> tuple[list, int]:
    """Outputs in prompt order, and the most blocks any decoding sequence held in one of
    ``groups`` (counted from the block tables after every step)."""
    ids = [engine.add_request(p, params) for p in ps]
    outs, most, decoding = {}, 0, set()
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
            elif len(o.token_ids) >= 2:  # past its prompt's chunks (a chunk needs its own blocks too)
                decoding.add(o.request_id)
        for seq_id, tables in engine.block_manager.tables.items():
            if seq_id in decoding:
                most = max(most, *(sum(1 for b in tables[g] if b >= 0) for g in groups))
    return [outs[i] for i in ids], most


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_streaming_heads_match_core_and_hold_only_sinks_and_window(tiny_llama, tmp_path, kv_dtype):
    """Streaming KV heads (split layers, a fully streaming layer): the same outputs as the plain
    run (fp32, int8 KV), full and streaming heads cached in separate groups, and the streaming
    groups never hold more than the sink blocks, the window's blocks and one block being filled per
    decoding sequence."""
    from attention_variants.convert import ConvertSpec, convert

    spec = ConvertSpec(sliding_window=8, sinks=5, streaming_set=((), (1,), (0, 1), (0,)))
    path = convert(tiny_llama, spec, tmp_path / "streaming").out
    # prefilled in the engine's chunks: a chunk reads its own rows exact, earlier ones as stored
    core = LLM(path, max_model_len=128, kv_cache_dtype=kv_dtype, prefill_chunk=12)
    bs = 4
    engine = Engine(core.model, EngineConfig(block_size=bs, max_num_batched_tokens=12, max_model_len=128,
                                             kv_cache_bytes=1 << 20, kv_dtype=kv_dtype))
    groups = engine.kv_spec.groups
    assert sorted((g.kind, g.num_kv_heads, g.layers) for g in groups) == [
        ("full", 1, (1, 3)), ("full", 2, (0,)), ("sliding", 1, (4, 5)), ("sliding", 2, (2,))]
    streaming = [g for g, grp in enumerate(groups) if grp.window is not None]
    ps = prompts(4, seed=3, lo=20, hi=40)
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=3, ignore_eos=True)
    outs, most = generate_counting_blocks(engine, ps, params, streaming)
    assert 0 < most <= -(-5 // bs) + -(-(8 + bs - 1) // bs) + 1
    if kv_dtype == "int4":  # packed KV is quantized per block, and the core picks its own block size
        return
    tol = LP_TOL if kv_dtype == "fp32" else 1e-3  # dequantized K/V meet different batch shapes: fp32 sums reorder
    for o, r in zip(outs, core.generate(ps, params)):
        assert_same(o, r, tol=tol)


def test_prefix_hits_and_preemption_keep_outputs(tiny_llama):
    core = LLM(tiny_llama, max_model_len=96)
    system = torch.arange(100, 140).tolist()  # a 40-token shared "system prompt"
    ps = prompts(16, seed=3, lo=1, hi=20, prefix=system)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    ref = core.generate(ps, params)
    # 24 blocks of 4 tokens: room for a few sequences only, so the scheduler must preempt.
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=64, max_model_len=96,
                                             kv_cache_bytes=24 * 4 * 4 * 2 * 2 * 32 * 4))
    assert engine.cache.num_blocks == (24,)
    out = engine.generate(ps, params)
    assert engine.stats.preemptions > 0
    assert engine.block_manager.prefix_hit_rate > 0.3
    assert any(o.num_cached_tokens >= 40 for o in out)
    for e, r in zip(out, ref):
        assert_same(e, r)
    assert engine.block_manager.pools[0].num_free == 24


def test_streaming_abort_and_prompt_logprobs(tiny_llama):
    core = LLM(tiny_llama, max_model_len=128)
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=8, max_model_len=128,
                                             kv_cache_bytes=2 << 20))
    p = prompts(1, seed=4, lo=20, hi=21)[0]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    pieces, final = [], None
    for o in engine.stream([p], params):
        pieces.extend(o.new_token_ids)
        final = o
    ref = core.generate([p], params)[0]
    assert pieces == final.token_ids == list(ref.outputs[0].token_ids)
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(p)
    for a, b in zip(final.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < LP_TOL
    # Abort: stop consuming a stream early; its blocks come back.
    it = engine.stream(prompts(3, seed=5), SamplingParams(max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    assert not engine.has_unfinished
    assert all(pool.num_free == pool.num_blocks for pool in engine.block_manager.pools)


def test_score_matches_core(tiny_checkpoints):
    core = LLM(tiny_checkpoints["gemma3_text"], max_model_len=128)
    engine = Engine(core.model, EngineConfig(block_size=4, max_num_batched_tokens=16, max_model_len=128,
                                             kv_cache_bytes=2 << 20))
    ids = prompts(1, seed=6, lo=100, hi=101)[0]
    torch.testing.assert_close(engine.score(ids), core.score(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int4"])
def test_target_logprobs_are_the_scores_without_the_logits_tensor(tiny_llama, kv_dtype):
    """``score_targets``: each next token's log-probability, the very numbers perplexity takes
    from ``score``'s logits (int4: scored a block at a time, as ``score``)."""
    from foundation.perplexity import perplexity, target_logprobs

    engine = Engine(load_model(tiny_llama, "float32"), EngineConfig(kv_dtype=kv_dtype, block_size=4,
                                                                    max_num_batched_tokens=16, max_model_len=128,
                                                                    kv_cache_bytes=2 << 20))
    ids = prompts(1, seed=6, lo=50, hi=51)[0]
    expected = target_logprobs(engine.score(ids)[:-1], torch.tensor(ids[1:]))
    assert torch.equal(engine.score_targets(ids), expected)
    assert engine.score_targets(ids[:1]).shape == (0,)
    by_logits = perplexity(lambda x: engine.score(x[0])[None], ids, "t", context=24, stride=12)
    by_targets = perplexity(None, ids, "t", context=24, stride=12, logprobs_fn=lambda x: engine.score_targets(x[0]))
    assert by_targets == by_logits


@pytest.mark.parametrize("kv_dtype,max_mean_err", [("int8", 0.02), ("fp8_e4m3", 0.05), ("bf16", 0.02)])
def test_quantized_kv_stays_close(tiny_llama, kv_dtype, max_mean_err):
    model = load_model(tiny_llama, "float32")
    ids = prompts(1, seed=7, lo=120, hi=121)[0]
    cfg = dict(block_size=4, max_num_batched_tokens=32, max_model_len=128, kv_cache_bytes=2 << 20)
    ref = torch.log_softmax(Engine(model, EngineConfig(**cfg)).score(ids), -1)
    got = torch.log_softmax(Engine(model, EngineConfig(kv_dtype=kv_dtype, **cfg)).score(ids), -1)
    err = (got.exp() * (got - ref)).sum(-1).mean()  # KL(quantized || fp32) per position
    assert 0 < err < max_mean_err
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.2  # away from near-ties the greedy token is unchanged
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.parametrize("kv_dtype,backend", [("int8", "torch"), ("fp8_e4m3", "torch"), ("int8", "triton")])
def test_a_prompt_is_attended_exact_and_scored_as_decoded(tiny_llama, kv_dtype, backend):
    """A prompt prefilled in one step reads its own rows exact whatever the KV dtype: its prompt
    logprobs are the fp32 cache's. ``score`` reads what decoding each token would: its own row
    exact, its context as stored, so scoring in pieces equals scoring a token at a time (decode
    steps); both attention backends (the kernels' backend on the CPU runs their torch references)."""
    model = load_model(tiny_llama, "float32")
    cfg = dict(block_size=4, max_num_batched_tokens=64, max_model_len=128, kv_cache_bytes=2 << 20,
               attention_backend=backend)
    exact, quantized = Engine(model, EngineConfig(**cfg)), Engine(model, EngineConfig(kv_dtype=kv_dtype, **cfg))
    p = prompts(1, seed=8, lo=40, hi=41)[0]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    a, b = (e.generate([p], params)[0] for e in (exact, quantized))
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < LP_TOL
    scored = quantized.score(p, pieces=[16, 16, len(p) - 32])
    assert not torch.allclose(exact.score(p), scored, atol=1e-3)
    # the same rows, up to a stored value a rounding flip apart (fp32 noise between the two paths
    # at a quantization boundary); reading the own row as stored instead is 4e-3 apart on average
    gap = (scored - quantized.score(p, pieces=[1] * len(p))).abs()
    assert gap.mean() < 2e-4 and gap.max() < 2e-3


@pytest.fixture(scope="module")
def sinks_checkpoint(tiny_llama, tmp_path_factory):
    """Sliding window 8 with 5 sinks on every layer but one."""
    from attention_variants.convert import ConvertSpec, convert

    return convert(tiny_llama, ConvertSpec(sliding_window=8, global_layers=(3,), sinks=5),
                   tmp_path_factory.mktemp("sinks") / "ckpt").out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout,kv_dtype", [("sinks", "int8"), ("sinks", "fp8_e4m3"), ("shared", "int8")])
def test_scoring_reads_what_decoding_reads_over_windows_and_shared_kv(sinks_checkpoint, kv_shared_checkpoint,
                                                                      layout, kv_dtype, backend):
    """Windows with sinks and layers reading another's KV: pieces that start mid-block score as a
    token at a time does."""
    path = sinks_checkpoint if layout == "sinks" else kv_shared_checkpoint
    engine = Engine(load_model(path, "float32"), EngineConfig(
        block_size=4, max_num_batched_tokens=64, max_model_len=128, kv_cache_bytes=2 << 20,
        attention_backend=backend, kv_dtype=kv_dtype))
    p = prompts(1, seed=9, lo=70, hi=71)[0]
    decoded = engine.score(p, pieces=[1] * len(p))
    for pieces in ([7, 13, 9, 21, 20], [5, 1, 1, 2, 61]):
        gap = (engine.score(p, pieces=pieces) - decoded).abs()
        assert gap.mean() < 2e-4 and gap.max() < 2e-3, pieces


def test_bad_requests(tiny_llama):
    engine = Engine(load_model(tiny_llama), EngineConfig(block_size=4, max_model_len=64, kv_cache_bytes=1 << 20))
    from foundation.errors import KvslimError

    with pytest.raises(KvslimError, match="max_model_len"):
        engine.add_request(list(range(64)))
    with pytest.raises(KvslimError, match="token ids"):
        engine.add_request([1, 999999])
    with pytest.raises(KvslimError, match="kv_cache_bytes"):
        Engine(load_model(tiny_llama), EngineConfig(block_size=4, max_model_len=512, kv_cache_bytes=1 << 14))
