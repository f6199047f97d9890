import pytest
import torch

from runtime.cache.kv_quant import dequantize, quantize_per_token_head, quantize_static


@pytest.mark.parametrize("qdtype,rel_tol", [(torch.float8_e4m3fn, 0.07), (torch.int8, 0.01)])
def test_per_token_head_roundtrip(qdtype, rel_tol):
    torch.manual_seed(0)
    x = torch.randn(7, 3, 64) * torch.logspace(-3, 2, 7)[:, None, None]
    q, s = quantize_per_token_head(x, qdtype)
    assert q.dtype == qdtype and s.shape == (7, 3) and s.dtype == torch.float32
    y = dequantize(q, s)
    # Error per element is bounded relative to that token/head's absmax.
    amax = x.abs().amax(-1, keepdim=True)
    assert ((y - x).abs() <= rel_tol * amax + 1e-12).all()
    # The absmax element is represented exactly (it maps to qmax).
    idx = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(y.gather(-1, idx), x.gather(-1, idx), rtol=1e-6, atol=0)


def test_zero_head_has_no_nan():
    q, s = quantize_per_token_head(torch.zeros(2, 2, 8), torch.int8)
    assert torch.isfinite(dequantize(q, s)).all() and (dequantize(q, s) == 0).all()


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8])
def test_static_scale_saturates(qdtype):
    scale = torch.tensor(0.01)
    x = torch.tensor([0.5, -0.5, 100.0, -100.0])
    y = dequantize(quantize_static(x, scale, qdtype), scale)
    qmax = 448.0 if qdtype == torch.float8_e4m3fn else 127.0
    assert y[2] == pytest.approx(qmax * 0.01) and y[3] == pytest.approx(-qmax * 0.01)
    assert y[0] == pytest.approx(0.5, rel=0.07)
