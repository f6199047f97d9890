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
