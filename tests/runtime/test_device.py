"""One device setting (``runtime.device.Placement``): resolved once, followed by the model, the KV
cache, the step's tensors and the sampling generators; ``--kernels triton`` serves through every
Triton kernel the GPU path calls, proven here under Triton's interpreter against the torch path."""
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from foundation.errors import KvslimError
from runtime.attention.triton_backend import KernelAttentionBackend
from runtime.device import CPU, Placement
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.kernels.kernel_linear import KernelLinear
from runtime.model.loader import load_model

PROMPTS = [list(range(5, 17)), list(range(40, 45)), list(range(100, 131))]
TOL = 1e-4  # fp32 on both sides: the kernels and the torch path differ only in the order of sums
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA resolves to")


@NO_CUDA
def test_auto_is_the_cpu_with_torch_kernels_here():
    assert Placement.resolve() == CPU == Placement.resolve("cpu", "torch")


@NO_CUDA
def test_cuda_without_cuda_is_one_line():
    with pytest.raises(KvslimError, match="no CUDA device"):
        Placement.resolve("cuda")


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KvslimError, match="TRITON_INTERPRET=1"):
        Placement.resolve("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Placement.resolve("cpu", "triton").triton_interpreted


@pytest.mark.parametrize("device,kernels,match", [("tpu", "auto", "unknown device"), ("cpu", "cuda", "unknown kernels")])
def test_unknown_names_are_one_line(device, kernels, match):
    with pytest.raises(KvslimError, match=match):
        Placement.resolve(device, kernels)


def test_the_interpreter_refuses_a_dtype_it_cannot_compute(tiny_llama):
    with pytest.raises(KvslimError, match="fp32 only"):
        load_model(tiny_llama, "bfloat16", placement=Placement.resolve("cpu", "triton"))


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """The tiny Llama in each weight scheme the Triton dequant-matmul computes."""
    from compress.quantize import quantize_checkpoint
    from foundation.schemes import FP8_W8A16, W4A16, W8A16

    root = tmp_path_factory.mktemp("schemes")
    return {s.name: quantize_checkpoint(tiny_checkpoints["llama"], root / s.name, s, progress=False).out
            for s in (W4A16, W8A16, FP8_W8A16)}


def _engine(path, kv_dtype: str, placement: Placement) -> Engine:
    model = load_model(path, "auto" if placement.triton_interpreted else "float32", use_cpu_kernels=False,
                       placement=placement)
    return Engine(model, EngineConfig(kv_dtype=kv_dtype, block_size=8, max_num_batched_tokens=32, max_model_len=96,
                                      kv_cache_bytes=1 << 20))


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the kernels through the interpreter on the CPU")
@pytest.mark.parametrize("scheme,kv_dtype", [("W4A16", "fp32"), ("W8A16", "int8"), ("FP8_W8A16", "int4"),
                                             ("W4A16", "int8")])
def test_triton_kernels_serve_the_torch_paths_tokens(quantized, scheme, kv_dtype):
    """Every Linear of the scheme, every KV store and attention call, and the fused small ops run a
    Triton kernel (interpreted); greedy tokens and logprobs equal the torch path's. (FP8 KV is left out: the
    interpreter's fp32 -> fp8 casts are wrong; compiled for sm_90 in CI instead.)"""
    ours = _engine(quantized[scheme], kv_dtype, Placement.resolve("cpu", "triton"))
    theirs = _engine(quantized[scheme], kv_dtype, CPU)
    kernel_linears = [m for m in ours.model.modules() if isinstance(m, KernelLinear)]
    assert kernel_linears and all(m.use_triton for m in kernel_linears)
    assert not any(isinstance(m, KernelLinear) for m in theirs.model.modules())
    assert ours.model.ops.fused and not theirs.model.ops.fused  # residual adds + norms, gated activations
    assert isinstance(ours.backend, KernelAttentionBackend) and ours.backend._attention.__module__.endswith(
        "paged_attention")
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
    for got, want in zip(ours.generate(PROMPTS, params), theirs.generate(PROMPTS, params)):
        for a, b, ta, tb in zip(got.logprobs, want.logprobs, got.token_ids, want.token_ids):
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < (TOL if kv_dtype == "fp32" else 1e-2)
            if ta != tb:
                assert b.top[0][1] - b.top[1][1] < 2e-2
                break


class FactoryWithoutDevice(TorchFunctionMode):
    """Records tensor factories called without ``device=``: each would land on the CPU whatever
    the engine's device. Host-side tensors name ``device="cpu"`` (``PagedBatch.build`` builds the
    step's metadata there and copies it to the device once)."""

    FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.rand,
                 torch.randn, torch.eye, torch.linspace}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            import traceback

            frame = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/runtime/" in f.filename)
            self.calls.append(f"{func.__name__} at {frame.filename.split('/runtime/')[-1]}:{frame.lineno}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("kv_dtype", ["fp32", "int4"])
def test_every_tensor_lives_on_the_engines_device(tiny_checkpoints, tmp_path, kv_dtype):
    """After construction every parameter, buffer and cache tensor is on the engine's device; a
    step (prefill, decode, seeded sampling, streaming heads) creates no tensor without naming the
    device: on a GPU any such tensor would be left on the CPU."""
    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "sh", "llama", streaming_heads={"window": 6, "sinks": 2,
                                                                            "kv_heads": [[], [1], [0, 1], [0]]})
    engine = _engine(path, kv_dtype, CPU)
    device = engine.device
    tensors = [*engine.model.parameters(), *engine.model.buffers(),
               *(t for group in engine.cache.tensors for t in group.values())]
    assert tensors and all(t.device == device for t in tensors)
    mode = FactoryWithoutDevice()
    params = [SamplingParams(max_tokens=4, temperature=0), SamplingParams(max_tokens=4, temperature=0.8, seed=1)]
    with mode:
        engine.generate(PROMPTS[:2], params)
    assert mode.calls == [], mode.calls


def test_the_package_serves_without_triton(tiny_llama):
    """triton is an optional extra: with it unimportable the runtime still loads and generates."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from runtime.engine.engine import Engine, EngineConfig\n"
        "from runtime.engine.sampling import SamplingParams\n"
        "from runtime.model.loader import load_model\n"
        f"engine = Engine(load_model({str(tiny_llama)!r}), EngineConfig(kv_dtype='int4', kv_cache_bytes=1 << 20,"
        " max_model_len=64))\n"
        "print(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("[")
