"""Decode steps compiled per bucket (``EngineConfig(compile_decode=True)``) give the eager engine's
tokens and logprobs: every weight scheme's CPU kernel, every KV dtype, the attention layouts
(sliding + softcap, KV read from another layer, streaming heads), and batches padded to a bucket.

Tolerances: in fp32 inductor only reorders sums (1e-4 on logprobs, as the engine's own batching
tests); in bf16 it keeps a fused loop's intermediates in fp32 where eager rounds each op to bf16, so
logprobs move by a few bf16 steps of a logit (0.1); W8A8 adds its per-token rounding ties
(tests/runtime/engine/test_engine_tiny.py: 0.15). Tokens may part only at a near-tie of the eager
run's top two, and then the comparison stops. With a quantized or bf16 cache a key 1e-7 apart can
round to the next code: 1e-3, as the engine's streaming-heads test."""
import pytest
import torch

from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.decode_graphs import DecodeGraphs, decode_buckets
from runtime.model.loader import load_model
from tests.runtime.engine.test_engine_tiny import prompts

PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)


def assert_same_tokens(got, ref, tol: float) -> None:
    for g, r in zip(got, ref):
        for t, (a, b) in enumerate(zip(g.token_ids, r.token_ids)):
            top_ref = dict(r.logprobs[t].top)
            for tok, lp in g.logprobs[t].top:
                if tok in top_ref:
                    assert abs(lp - top_ref[tok]) < tol, (t, tok, lp, top_ref[tok])
            if a != b:
                assert r.logprobs[t].top[0][1] - r.logprobs[t].top[1][1] < tol, f"tokens part at {t} without a near-tie"
                break
        else:
            assert g.token_ids == r.token_ids


def run_both(model, n_prompts: int = 3, **config) -> tuple[list, list, Engine]:
    """Outputs of the eager and the compiled engine over the same model and prompts (3 prompts
    decode in bucket 4: one padded row)."""
    cfg = dict(block_size=4, max_num_batched_tokens=64, max_model_len=96, kv_cache_bytes=2 << 20, max_num_seqs=4)
    cfg.update(config)
    ps = prompts(n_prompts, seed=11, lo=5, hi=30)
    ref = Engine(model, EngineConfig(**cfg)).generate(ps, PARAMS)
    compiled = Engine(model, EngineConfig(compile_decode=True, **cfg))
    return compiled.generate(ps, PARAMS), ref, compiled


class CpuModule(torch.nn.Linear):
    device = torch.device("cpu")


def test_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    graphs = DecodeGraphs(CpuModule(1, 1), 6)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError, match="exceed"):
        graphs.bucket(7)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # full attention / sliding + softcap + sandwich norms
def test_compiled_decode_matches_eager(tiny_checkpoints, arch):
    model = load_model(tiny_checkpoints[arch], "float32")
    got, ref, engine = run_both(model)
    assert_same_tokens(got, ref, tol=1e-4)
    # one prefill step (eager), then every decode step compiled for bucket 4
    assert engine.graphs.compiled_buckets == (4,) and engine.graphs.steps == engine.stats.steps - 1 == 5


def test_buckets_compiled_ahead_serve_without_compiling(tiny_llama):
    model = load_model(tiny_llama, "float32")
    cfg = dict(block_size=4, max_num_batched_tokens=64, max_model_len=96, kv_cache_bytes=2 << 20, max_num_seqs=8)
    engine = Engine(model, EngineConfig(compile_decode=True, **cfg))
    assert engine.graphs.compile(3) == (1, 2, 4) and engine.graphs.compile(4) == ()
    assert engine.graphs.compiled_buckets == (1, 2, 4)
    ps = prompts(3, seed=12, lo=5, hi=30)
    graphs_before = dict(torch._dynamo.utils.counters["stats"])
    got = engine.generate(ps, PARAMS)  # 3 rows, then fewer as requests finish
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs_before  # nothing traced or compiled again
    assert engine.graphs.compiled_buckets == (1, 2, 4) and engine.graphs.steps > 0
    assert_same_tokens(got, Engine(model, EngineConfig(**cfg)).generate(ps, PARAMS), tol=1e-4)
    assert all(p.num_free == p.num_blocks for p in engine.block_manager.pools)  # compiling wrote no cache


def test_python_wrapper_matches_eager(tiny_llama):
    """``graphs.cpp_wrapper = False``, as ``benchmarks/decode_profile.py`` compiles to see each op."""
    model = load_model(tiny_llama, "float32")
    cfg = dict(block_size=4, max_num_batched_tokens=64, max_model_len=96, kv_cache_bytes=2 << 20, max_num_seqs=2)
    ps = prompts(2, seed=13, lo=5, hi=30)
    engine = Engine(model, EngineConfig(compile_decode=True, **cfg))
    engine.graphs.cpp_wrapper = False
    got = engine.generate(ps, PARAMS)
    assert engine.graphs.compiled_buckets == (2,) and engine.graphs.steps > 0
    assert_same_tokens(got, Engine(model, EngineConfig(**cfg)).generate(ps, PARAMS), tol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "int8", "int4", "int2"])
def test_compiled_decode_matches_eager_per_kv_dtype(tiny_llama, kv_dtype):
    model = load_model(tiny_llama, "float32")
    got, ref, _ = run_both(model, kv_dtype=kv_dtype, n_prompts=2)
    assert_same_tokens(got, ref, tol=1e-3)  # a reordered sum can move a key by one quantization step


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16", "W8A16", "FP8_DYNAMIC"])
def test_compiled_decode_matches_eager_per_weight_scheme(tiny_llama, tmp_path, monkeypatch, scheme):
    """Each scheme's fastest CPU kernel: W8A8 through ``torch._int_mm`` (a CPU with VNNI), INT4/INT8
    weight-only through torch's packed kernels (bf16 activations), FP8 dequantized per forward."""
    from compress.quantize import quantize_checkpoint
    from foundation.schemes import PRESETS
    from runtime.model.layers.activation_dtype import CpuFeatures
    from runtime.model.layers.linear import Int4PackLinear, Int8PackLinear, W8A8Linear

    path = quantize_checkpoint(tiny_llama, tmp_path / scheme, PRESETS[scheme], progress=False).out
    vnni = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=True, amx=False)
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: vnni))
    dtype = "bfloat16" if scheme in ("W4A16", "W8A16") else "float32"
    model = load_model(path, dtype)
    kernel = {"W8A8": W8A8Linear, "W4A16": Int4PackLinear, "W8A16": Int8PackLinear}.get(scheme)
    if kernel is not None:
        assert any(isinstance(m, kernel) and getattr(m, "use_int_mm", True) for m in model.modules())
    got, ref, _ = run_both(model, n_prompts=2)
    assert_same_tokens(got, ref, tol={"W8A8": 0.15, "W4A16": 0.1, "W8A16": 0.1}.get(scheme, 1e-4))


def test_compiled_decode_with_streaming_heads(tiny_llama, tmp_path):
    """Several attention calls per layer: full and streaming heads, each its own cache group."""
    from attention_variants.convert import ConvertSpec, convert

    spec = ConvertSpec(sliding_window=8, sinks=5, streaming_set=((), (1,), (0, 1), (0,)))
    model = load_model(convert(tiny_llama, spec, tmp_path / "streaming").out, "float32")
    got, ref, _ = run_both(model)
    assert_same_tokens(got, ref, tol=1e-4)


def test_compiled_decode_with_shared_kv(kv_shared_checkpoint):
    """Layers reading another layer's KV (k = v = None through the opaque attention op)."""
    got, ref, _ = run_both(load_model(kv_shared_checkpoint, "float32"))
    assert_same_tokens(got, ref, tol=1e-4)


def test_compile_decode_is_cpu_only():
    from foundation.errors import KvslimError

    class OnCuda(torch.nn.Linear):
        device = torch.device("cuda")

    with pytest.raises(KvslimError, match="CPU only"):
        DecodeGraphs(OnCuda(1, 1), 4)


def test_a_failed_compile_is_one_line(tiny_llama, monkeypatch):
    """What torch.compile raises (say, no C++ compiler for inductor's CPU code) reaches the user as
    one ``KvslimError`` line naming the batch size and the way out."""
    from foundation.errors import KvslimError

    graphs = DecodeGraphs(load_model(tiny_llama, "float32"), 4)

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore lines")

    monkeypatch.setattr(graphs, "_compiled", no_compiler)
    with pytest.raises(KvslimError, match=r"batch size 1 \(RuntimeError: InvalidCxxCompiler: No working C\+\+ "
                                          r"compiler found\); serve without --compile-decode$"):
        graphs.compile(1)
    assert graphs.compiled_buckets == ()


class _Recording:
    """A backend that says which one answered."""

    def __init__(self, value: float):
        self.value = value

    def attend(self, layer_idx, q, k, v):
        return torch.full_like(q, self.value)


def test_each_decode_graphs_owns_its_step(tiny_llama):
    """No process-wide step state: the opaque attention op asks the DecodeGraphs whose handle its
    graph carries for the backend and rows of the step that instance runs."""
    model = load_model(tiny_llama, "float32")
    first, second = DecodeGraphs(model, 4), DecodeGraphs(model, 4)
    assert first._opaque.graphs != second._opaque.graphs
    q = torch.zeros(4, 2, 8)
    first.step, second.step = (_Recording(1.0), 3), (_Recording(2.0), 4)
    out = first._opaque.attend(0, q, None, None)
    assert out[:3].eq(1.0).all() and out[3].eq(0.0).all()  # padded rows: zeros
    assert second._opaque.attend(0, q, None, None).eq(2.0).all()
    first.step = None
    with pytest.raises(AssertionError, match="outside DecodeGraphs.run"):
        first._opaque.attend(0, q, None, None)
