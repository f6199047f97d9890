import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without CUDA, Triton kernels run in its interpreter; this must be set before any @triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

# CI explores the same examples on every run (a failure there is reproducible, never a coin toss);
# local runs keep hypothesis' random exploration, which is how new bugs are found.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

from tests.tiny_models import ARCHITECTURES, make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """One tiny random fp32 checkpoint per supported architecture: {model_type: Path}."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def default_model_dir():
    """The real default model (SmolLM2-135M-Instruct, dequantized GGUF), converted once and cached."""
    from foundation.model_source import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def tiny_with_tokenizer(default_model_dir, tmp_path_factory):
    """A tiny random Llama that shares the default model's tokenizer (so real text tokenizes)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tok") / "tiny", "llama",
                                tokenizer_from=default_model_dir, vocab_size=49152)


@pytest.fixture(scope="session", autouse=True)
def auto_dtype_without_native_bf16():
    """``dtype="auto"`` resolves by the CPU's features (bf16 where the CPU has native bf16). Tests
    compare against fp32 references and must not depend on the machine, so in-process code sees
    a CPU without native bf16 and ``auto`` means float32; the tests of the choice itself
    (tests/runtime/model/layers/test_activation_dtype.py) pass their features explicitly."""
    from runtime.model.layers.activation_dtype import CpuFeatures

    plain = CpuFeatures(avx2=True, avx512=False, vnni=False, avx512_bf16=False, amx=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuFeatures, "detect", classmethod(lambda cls: plain))
        yield
