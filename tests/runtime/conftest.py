"""Kernel and kernel-backend tests (the ``device`` fixture) run on CUDA when present, else under
TRITON_INTERPRET=1 (set in tests/conftest.py before triton is imported). The interpreter runs fp32 inputs only (it miscomputes bf16 dots and
fp32 -> fp8/bf16 casts), so CPU tests use fp32 activations; bit-exact and real-size checks are the
``gpu`` tests."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="session")
def device() -> torch.device:
    if not HAS_CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET before triton loads"
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def kv_shared_checkpoint(tmp_path_factory):
    # KV sharing + sliding + full in one model: layer 1 reads 0, layer 3 reads 2.
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_share") / "m", "qwen3",
        sliding_window=8, layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2,
        kv_source_layers=[0, 0, 2, 2], use_sliding_window=True,
    )
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    readers = ("model.layers.1.", "model.layers.3.")
    kv = (".k_proj.", ".v_proj.", ".k_norm.")
    save_file({k: v for k, v in tensors.items() if not (k.startswith(readers) and any(s in k for s in kv))},
              shard, metadata={"format": "pt"})
    return path
