"""The CUDA-graph decode path proven without a GPU: ``CudaDecodeGraphs(capture=False)`` runs the very
forward a graph captures (persistent buffers, padded buckets, fixed launch shapes) eagerly through
the Triton kernels under the interpreter, in fp32.

Oracles: the eager engine's greedy tokens and logprobs (every KV dtype, packed int4/int2 with their
per-row write plans included, sliding windows with sinks and softcap, streaming heads, KV read from
another layer; padded rows in the bucket), and a recording torch-function mode that sees no tensor
made from host data and no read back to the host during the replayed part of a step (what a capture
forbids on CUDA). Tolerances as tests/runtime/model/test_decode_graphs.py:
1e-4 on logprobs in fp32, 1e-3 with a quantized cache (a key 1e-7 apart can round to the next code)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.engine.cuda_graphs import CudaDecodeGraphs, DecodeInputs, DecodeRow, DecodeShape, graph_buckets
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model
from tests.runtime.engine.test_engine_tiny import prompts
from tests.runtime.kernels.launch_counter import inside_triton
from tests.runtime.model.test_decode_graphs import assert_same_tokens

PARAMS = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
CONFIG = dict(block_size=4, max_num_batched_tokens=64, max_model_len=96, kv_cache_bytes=2 << 20, max_num_seqs=8)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="drives the kernels through the interpreter")


def kernel_engine(model, graphed: bool, **config) -> Engine:
    """The engine with the Triton kernels forced (interpreted), and the graph runner eager."""
    engine = Engine(model, EngineConfig(attention_backend="triton", **{**CONFIG, **config}))
    engine.backend = KernelAttentionBackend(engine.cache, engine.backend.params, use_triton=True)
    if graphed:
        shape = DecodeShape(engine.config.max_num_seqs, engine.block_size, engine.max_model_len,
                            len(engine.kv_spec.groups))
        engine.cuda_graphs = CudaDecodeGraphs(model, engine.backend, shape, capture=False)
    assert (engine.cuda_graphs is not None) == graphed
    return engine


def run_both(model, n_prompts: int = 5, **config):
    """5 prompts decode in bucket 8 (three padded rows), then fewer as requests finish."""
    ps = prompts(n_prompts, seed=21, lo=5, hi=30)
    graphed = kernel_engine(model, True, **config)
    got = graphed.generate(ps, PARAMS)
    ref = kernel_engine(model, False, **config).generate(ps, PARAMS)
    assert all(p.num_free == p.num_blocks for p in graphed.block_manager.pools)
    return got, ref, graphed


def test_buckets():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(20) == (1, 2, 4, 8, 16, 20)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])  # full attention / sliding + sinks-free softcap
def test_static_decode_matches_the_eager_engine(tiny_checkpoints, arch):
    got, ref, engine = run_both(load_model(tiny_checkpoints[arch], "float32"))
    assert_same_tokens(got, ref, tol=1e-4)
    # prefill (two chunks) eager, then every pure decode step through the static buffers
    assert engine.cuda_graphs.steps == engine.stats.steps - 2 == 4


@pytest.mark.parametrize("kv_dtype,tol", [("fp8_e4m3", 1e-3), ("int8", 1e-3), ("int4", 2e-2)])
def test_static_decode_per_kv_dtype(tiny_llama, kv_dtype, tol):
    """int4: blocks of 4 fill and quantize during decode (per-row plans). A padded bucket's GEMMs
    round 1e-7 differently, and a 4-bit code one level off moves a logprob by up to 1e-2 (without
    padding the caches are equal, below, where int2, with its exact first block, and k3v2 are
    checked bit for bit: padding is the same code for every packed width)."""
    got, ref, engine = run_both(load_model(tiny_llama, "float32"), kv_dtype=kv_dtype, n_prompts=3)
    assert_same_tokens(got, ref, tol=tol)
    assert all(s is None or s.open_blocks == 0 for s in engine.cache.residual_slots)  # every slot given back


@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k3v2"])
def test_packed_cache_equals_the_eager_engines_in_a_full_bucket(tiny_llama, kv_dtype):
    """Four requests fill bucket 4: no padded row, the same GEMMs, so the per-row write plans
    must leave every code, scale and residual row bit for bit where the eager step's plans do.
    k4v2 is int4's keys beside int2's values (its store, per width, in tests/runtime/kernels)."""
    model = load_model(tiny_llama, "float32")
    ps = prompts(4, seed=21, lo=5, hi=30)
    engines = [kernel_engine(model, graphed, kv_dtype=kv_dtype) for graphed in (True, False)]
    got, ref = (e.generate(ps, PARAMS) for e in engines)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert engines[0].cuda_graphs.steps == 4
    for name, t in engines[0].cache.tensors[0].items():
        assert torch.equal(t, engines[1].cache.tensors[0][name]), name


@pytest.mark.parametrize("kv_dtype,tol", [("fp32", 1e-4), ("int8/fp8_e4m3", 1e-3), ("int4/int2", 2e-2)])
def test_static_decode_with_streaming_heads_and_sinks(tiny_llama, tmp_path, kv_dtype, tol):
    """Several attention entries per layer, each its own cache group, window and sinks (and with a
    mix, its own KV dtype)."""
    from attention_variants.convert import ConvertSpec, convert

    spec = ConvertSpec(sliding_window=8, sinks=5, streaming_set=((), (1,), (0, 1), (0,)))
    model = load_model(convert(tiny_llama, spec, tmp_path / "streaming").out, "float32")
    got, ref, engine = run_both(model, n_prompts=3, kv_dtype=kv_dtype)
    assert {g.kv_dtype for g in engine.kv_spec.groups} == set(kv_dtype.split("/"))
    assert_same_tokens(got, ref, tol=tol)


def test_static_decode_with_shared_kv(kv_shared_checkpoint):
    got, ref, _ = run_both(load_model(kv_shared_checkpoint, "float32"), n_prompts=3)
    assert_same_tokens(got, ref, tol=1e-4)


def test_graphs_only_on_cuda_and_not_when_eager_is_enforced(tiny_llama):
    model = load_model(tiny_llama, "float32")
    assert Engine(model, EngineConfig(**CONFIG)).cuda_graphs is None  # the CPU
    assert Engine(model, EngineConfig(enforce_eager=True, **CONFIG)).cuda_graphs is None


class HostTraffic(TorchFunctionMode):
    """Records calls that read a tensor back to the host or build one from host data, made by kvslim
    (Triton's interpreter copies tensors to numpy by design: its own frames are not counted)."""

    WATCHED = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
               torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.tensor, torch.as_tensor,
               torch.from_numpy}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WATCHED and not inside_triton():
            caller = sys._getframe(1)
            self.calls.append(f"{getattr(func, '__name__', func)} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_a_replay_reads_nothing_back_and_builds_no_tensor_from_host_data(tiny_checkpoints, kv_dtype):
    """The replayed part of a step (``CudaDecodeGraphs.replay``); ``prepare`` is the host's part,
    packed write planning included. Prompts of 3, 4 and 7 tokens: with blocks of 4 the first
    decode step writes positions 3, 4 and 7, filling two blocks and opening one."""
    model = load_model(tiny_checkpoints["gemma3_text"], "float32")
    engine = kernel_engine(model, True, kv_dtype=kv_dtype)
    for p in ([5, 6, 7], [8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9]):
        engine.add_request(p, PARAMS)
    engine.step()  # prefill (eager, may read the host)
    tables = engine.block_manager.block_tables
    with torch.inference_mode():
        for seq in engine.scheduler.running:  # the blocks the step writes
            engine.block_manager.append(seq.seq_id, seq.num_tokens - 1, seq.num_tokens)
        rows = [DecodeRow(s.token_slice(s.num_tokens - 1, s.num_tokens)[0], s.num_tokens - 1, tables(s.seq_id))
                for s in engine.scheduler.running]
        bucket = engine.cuda_graphs.prepare(rows)
        with HostTraffic() as traffic:
            hidden = engine.cuda_graphs.replay(bucket)
    assert hidden.shape == (4, model.spec.hidden_size) and torch.isfinite(hidden).all()
    assert traffic.calls == []
    if kv_dtype == "int4":
        plan = engine.cuda_graphs.inputs.batch(bucket).write_plans[0]
        assert plan.per_row and (plan.full >= 0).tolist() == [True, False, True, False]  # padded row last


def test_padded_rows_write_nothing_and_read_nothing():
    """Rows past the real ones: slot -1 (the store skips them), context 0 (attention reads nothing)."""
    inputs = DecodeInputs(DecodeShape(max_rows=8, block_size=4, max_model_len=32, num_groups=2), torch.device("cpu"))
    inputs.fill([DecodeRow(7, 5, ([3, 9], [-1, 6])), DecodeRow(8, 0, ([2], [1]))], bucket=4)
    batch = inputs.batch(4)
    assert batch.context_lens.tolist() == [6, 1, 0, 0]
    assert batch.slot_mapping[0].tolist() == [9 * 4 + 1, 2 * 4, -1, -1]
    assert batch.slot_mapping[1].tolist() == [6 * 4 + 1, 1 * 4, -1, -1]
    assert batch.block_tables[1][0, :2].tolist() == [0, 6]  # a released window block reads as 0, never read
    assert inputs.ids[:4].tolist() == [7, 8, 0, 0] and inputs.positions[:4].tolist() == [5, 0, 0, 0]
    inputs.fill([DecodeRow(1, 2, ([5], [5]))], bucket=1)  # a smaller bucket later: row 1 is the next bucket's padding
    inputs.fill([DecodeRow(1, 3, ([5], [5]))], bucket=2)
    assert inputs.batch(2).context_lens.tolist() == [4, 0]
