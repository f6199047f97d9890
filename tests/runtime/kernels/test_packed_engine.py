"""The engine with int4/int2/k4v2/k3v2 KV through the kernel attention backend gives the torch backend's
logits: on CPU the backend runs the kernels' torch references; forced, the Triton kernels (in
the interpreter)."""
import pytest
import torch

from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model
from tests.tiny_models import make_tiny_checkpoint

IDS = list(range(3, 60))
PIECES = [20, 1, 1, 13, 1, 21]  # a prefill, decodes and extends, filling blocks mid-piece
PROMPTS = [list(range(5, 17)), list(range(40, 45)), list(range(100, 131))]
# One layer: its K/V come from the embeddings, so both backends store bit-identical caches and
# only the order of fp32 sums differs (SDPA against reference_attention or the kernel).
EXACT_TOL = 1e-4
# Deeper, the K/V of layer l differ by the ulps of the layers below, and a value that close to a
# half-step lands on the next code, or a channel's range on the next fp16 scale (1e-3 relative):
# a few 1e-3 on logprobs (2.4e-3 measured on the 4-layer tiny Llama at int4, block 8), against
# a quantization error of 1 to 3 (int4 / int2 against fp32 KV) on logits of about 4.
DEEP_TOL = 1e-2


def config(kv_dtype: str, block_size: int) -> dict:
    return dict(kv_dtype=kv_dtype, block_size=block_size, max_num_batched_tokens=32, max_model_len=96,
                kv_cache_bytes=1 << 20)


def assert_same(ours: Engine, theirs: Engine, tol: float) -> None:
    torch.testing.assert_close(ours.score(IDS, PIECES), theirs.score(IDS, PIECES), rtol=tol, atol=tol)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    for got, want in zip(ours.generate(PROMPTS, params), theirs.generate(PROMPTS, params)):
        for a, b, ta, tb in zip(got.logprobs, want.logprobs, got.token_ids, want.token_ids):
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < tol
            if ta != tb:  # greedy choices swap only at a near-tie
                assert b.top[0][1] - b.top[1][1] < 2 * tol
                break
    assert all(layer.open_blocks == 0 for group in ours.cache.packed for layer in group)


@pytest.mark.parametrize("kv_dtype", ["int4", "int2", "k4v2", "k3v2"])
def test_engine_with_the_triton_backend_gives_the_torch_backends_logits(tmp_path, kv_dtype):
    model = load_model(make_tiny_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=1), "float32")
    ours = Engine(model, EngineConfig(attention_backend="triton", **config(kv_dtype, 8)))
    theirs = Engine(model, EngineConfig(**config(kv_dtype, 8)))
    assert isinstance(ours.backend, KernelAttentionBackend)
    assert_same(ours, theirs, EXACT_TOL)
    for name, t in ours.cache.tensors[0].items():
        assert torch.equal(t, theirs.cache.tensors[0][name]), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine keeps its cache on the CPU; this drives the kernels through the interpreter")
@pytest.mark.parametrize("arch,kv_dtype,block_size", [("llama", "int4", 16), ("gemma3_text", "int2", 8),
                                                          ("llama", "k4v2", 8), ("llama", "k3v2", 16)])
def test_engine_through_the_packed_kernels(tmp_path, arch, kv_dtype, block_size):
    """Block 16: key tiles inside one block; block 8: keys looked up one by one. gemma3 adds
    sliding-window layers and one KV head for four query heads."""
    model = load_model(make_tiny_checkpoint(tmp_path / arch, arch), "float32")
    ours = Engine(model, EngineConfig(**config(kv_dtype, block_size)))
    ours.backend = KernelAttentionBackend(ours.cache, ours.backend.params, use_triton=True)
    assert_same(ours, Engine(model, EngineConfig(**config(kv_dtype, block_size))), DEEP_TOL)
