"""The fused residual-add + RMSNorm, rotary and gated-activation kernels against their torch
references (``RMSNorm``, ``apply_rotary``, ``GatedMLP``'s expression); fp32 under Triton's
interpreter, bf16 on a GPU."""
import pytest
import torch

from foundation.errors import KvslimError
from runtime.attention.key_rope import apply_rotary, rotary_cos_sin
from runtime.kernels.add_rms_norm import add_rms_norm
from runtime.kernels.gated_activation import gated_activation
from runtime.kernels.rotary import rotary
from runtime.model.layers.mlp import activation
from runtime.model.layers.norm import RMSNorm
from tests.runtime.conftest import requires_gpu

CASES = [(torch.float32, "cpu"), pytest.param(torch.bfloat16, "cuda", marks=[requires_gpu, pytest.mark.gpu])]


def _norm(hidden: int, offset: float, dtype: torch.dtype, device: str) -> RMSNorm:
    n = RMSNorm(hidden, 1e-5, offset)
    w = torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.1 + (0.0 if offset else 1.0)
    n.weight.data = w.float() if offset else w.to(dtype)  # as DecoderLayer stores them
    return n.to(device)


@pytest.mark.parametrize("dtype,device", CASES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_add_and_rmsnorm(dtype, device, offset, with_residual):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 576, generator=g).to(device, dtype) * 3 for _ in range(2))
    norm = _norm(576, offset, dtype, device)
    total, out = add_rms_norm(x, r if with_residual else None, norm.weight, norm.eps, offset)
    ref_total = x + r if with_residual else x
    assert torch.equal(total, ref_total)  # the torch add, rounded the same way
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # fp32 sum orders; one bf16 rounding step
    torch.testing.assert_close(out, norm(ref_total), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,device", CASES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_matches_the_torch_expression(dtype, device, act):
    g = torch.Generator().manual_seed(2)
    fused = torch.randn(7, 2 * 1536, generator=g).to(device, dtype) * 4
    gate, up = fused[:, :1536], fused[:, 1536:]  # views of one gate-up GEMM, row stride 2I
    out = gated_activation(gate, up, act)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, activation(act)(gate) * up, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,device", CASES)
def test_rotary_matches_apply_rotary_on_views_of_the_qkv_output(dtype, device):
    t, heads, kvh, d = 6, 9, 3, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(t, (heads + 2 * kvh) * d, generator=g).to(device, dtype)
    q, k, _ = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    positions = torch.tensor([0, 1, 7, 100, 2047, 4000], device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = (c[:, None, :] for c in rotary_cos_sin(positions, inv_freq.to(device), 1.0, dtype))
    for x in (q.view(t, heads, d), k.view(t, kvh, d)):
        out = rotary(x, cos, sin)
        assert out.is_contiguous() and out.shape == x.shape
        if dtype == torch.float32:
            assert torch.equal(out, apply_rotary(x, cos, sin))  # the same three fp32 operations
        else:
            torch.testing.assert_close(out, apply_rotary(x, cos, sin), rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_one_line_errors():
    x = torch.randn(3, 8)
    with pytest.raises(KvslimError, match="residual must match"):
        add_rms_norm(x, torch.randn(3, 9), torch.ones(8), 1e-5)
    with pytest.raises(KvslimError, match="weight must be"):
        add_rms_norm(x, None, torch.ones(9), 1e-5)
    with pytest.raises(KvslimError, match="unsupported activation"):
        gated_activation(x, x, "relu")
    with pytest.raises(KvslimError, match="gate and up"):
        gated_activation(x, x.t(), "silu")
    with pytest.raises(KvslimError, match="cos and sin"):
        rotary(torch.randn(2, 3, 8), torch.ones(2, 8), torch.ones(2, 8))
    with pytest.raises(KvslimError, match="even head_dim"):
        rotary(torch.randn(2, 3, 7), torch.ones(2, 1, 7), torch.ones(2, 1, 7))
    empty = torch.empty(0, 8)
    assert add_rms_norm(empty, empty, torch.ones(8), 1e-5)[1].shape == (0, 8)
    assert gated_activation(empty, empty, "silu").shape == (0, 8)
