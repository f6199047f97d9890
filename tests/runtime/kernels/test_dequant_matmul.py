import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)

from foundation import primitives, schemes
from foundation.errors import KvslimError
from runtime.kernels import dequant_matmul as dm
from tests.runtime.conftest import requires_gpu


def make_int_weight(N, K, bits, group, symmetric, act_order, seed=0, scale_dtype=torch.float32):
    """Random pack-quantized tensors written with compressed-tensors' own packer, and the dense
    weight they stand for (computed here from the int8 values, independently of the kernels)."""
    g = torch.Generator().manual_seed(seed)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, K // group, generator=g) * 0.05 + 0.005).to(scale_dtype)
    zp = None if symmetric else torch.randint(-half, half, (N, K // group), generator=g, dtype=torch.int8)
    g_idx = (torch.randperm(K, generator=g) // group).to(torch.int32) if act_order else None
    groups = g_idx.long() if act_order else torch.arange(K) // group
    dense = (q.float() - (0 if zp is None else zp.float()[:, groups])) * scale.float()[:, groups]
    tensors = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scale}
    if zp is not None:
        tensors["weight_zero_point"] = pack_to_int32(zp, bits, packed_dim=0)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx
    return tensors, dense


def int_args(t, bits):
    return t["weight_packed"], t["weight_scale"], bits, t.get("weight_zero_point"), t.get("weight_g_idx")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_reference_dequantize_matches_compressed_tensors(bits, symmetric, act_order):
    N, K, group = 36, 128, 32  # N not a multiple of 8: zero points pad the last packed row
    t, dense = make_int_weight(N, K, bits, group, symmetric, act_order)
    w = dm.reference_dequantize_int_weight(*int_args(t, bits))
    assert torch.equal(w, dense)
    # the library's own unpacker agrees on the stored values
    q = unpack_from_int32(t["weight_packed"], bits, torch.Size([N, K]))
    assert torch.equal(dm.reference_unpack(t["weight_packed"], bits, K) - (1 << (bits - 1)), q.int())


@pytest.mark.parametrize("scheme", [schemes.W4A16, schemes.W4A16_ASYM, schemes.W8A16])
def test_reference_dequantize_matches_primitives(scheme):
    w = torch.randn(24, 128)
    scale, zp = primitives.compute_qparams(w, scheme)
    tensors = primitives.encode_linear(primitives.quantize(w, scale, zp, scheme), scale, zp, scheme)
    ours = dm.reference_dequantize_int_weight(
        tensors["weight_packed"], tensors["weight_scale"], scheme.num_bits, tensors.get("weight_zero_point"))
    assert torch.equal(ours.to(tensors["weight_scale"].dtype), primitives.dequantize_linear(tensors, scheme))


CASES = [  # (bits, group, symmetric, act_order)
    (4, 32, True, False),
    (4, 128, False, False),
    (4, 64, False, True),
    (8, 128, True, False),
    (8, 32, False, True),
]


@pytest.mark.parametrize("bits,group,symmetric,act_order", CASES)
@pytest.mark.parametrize("M", [1, 20])
def test_int_weight_matmul_matches_reference(device, bits, group, symmetric, act_order, M):
    N, K = 40, 256
    t, dense = make_int_weight(N, K, bits, group, symmetric, act_order, seed=M)
    t = {k: v.to(device) for k, v in t.items()}
    x = torch.randn(M, K, device=device)
    y = dm.int_weight_matmul(x, *int_args(t, bits))
    ref = dm.reference_int_weight_matmul(x, *int_args(t, bits))
    assert y.shape == (M, N) and y.dtype == x.dtype
    torch.testing.assert_close(ref.cpu(), x.cpu() @ dense.t(), rtol=1e-5, atol=1e-5)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("M", [2, 33])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_weight_matmul_matches_reference(device, M, per_tensor):
    N, K = 48, 192
    w = (torch.randn(N, K) * 3).to(torch.float8_e4m3fn).to(device)
    s = (torch.rand(1 if per_tensor else N, 1) * 0.1).to(device)
    x = torch.randn(M, K, device=device)
    y = dm.fp8_weight_matmul(x, w, s)
    ref = dm.reference_fp8_weight_matmul(x, w, s)
    torch.testing.assert_close(ref, x @ (w.float() * s).t())
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_fp8_w8a8_reference_is_close_to_the_unquantized_product():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64)
    s = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / s).to(torch.float8_e4m3fn)
    exact = x.float() @ (w8.float() * s).t()
    ref = dm.reference_fp8_w8a8_matmul(x, w8, s)
    assert ref.dtype == torch.bfloat16
    # FP8 E4M3 activations: ~2^-4 relative error per element, averaged over K=64
    assert (ref.float() - exact).abs().max() < 0.08 * exact.abs().max()


def test_bad_inputs_raise_one_line_errors():
    t, _ = make_int_weight(16, 64, 4, 32, True, False)
    with pytest.raises(KvslimError, match="in_features 64"):
        dm.reference_int_weight_matmul(torch.randn(2, 32), *int_args(t, 4))
    with pytest.raises(KvslimError, match="4 or 8 bits"):
        dm.int_weight_shapes(t["weight_packed"], t["weight_scale"], 3, None, None)
    with pytest.raises(KvslimError, match="weight_zero_point"):
        dm.int_weight_shapes(t["weight_packed"], t["weight_scale"], 4, torch.zeros(3, 2, dtype=torch.int32), None)
    with pytest.raises(KvslimError, match="float8_e4m3fn"):
        dm.fp8_weight_shapes(torch.zeros(4, 4), torch.ones(4, 1))
    with pytest.raises(KvslimError, match="bf16 activations"):
        dm.fp8_w8a8_matmul(torch.randn(2, 4), torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(4, 1))


# ------------------------------------------------------------------ GPU: real sizes, bf16
@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,symmetric,act_order", CASES)
@pytest.mark.parametrize("M", [1, 16, 300])
@pytest.mark.parametrize("NK", [(1536, 576), (4096, 4096)])
def test_gpu_int_weight_matmul_real_sizes(bits, group, symmetric, act_order, M, NK):
    N, K = NK
    if K % group:
        pytest.skip("group does not divide K")
    t, _ = make_int_weight(N, K, bits, group, symmetric, act_order, scale_dtype=torch.bfloat16)
    t = {k: v.cuda() for k, v in t.items()}
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = dm.int_weight_matmul(x, *int_args(t, bits))
    ref = dm.reference_int_weight_matmul(x, *int_args(t, bits))
    # bf16 dequantized weights (TILE_IN_GROUP keeps them exact) and bf16 output rounding
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 300])
def test_gpu_fp8_matmuls_real_sizes(M):
    N, K = 4096, 4096
    w = torch.randn(N, K, device="cuda")
    s = w.abs().amax(dim=1, keepdim=True) / 448
    w8 = (w / s).to(torch.float8_e4m3fn)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = dm.reference_fp8_weight_matmul(x, w8, s).float()
    y = dm.fp8_weight_matmul(x, w8, s).float()
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    if torch.cuda.get_device_capability() >= (8, 9):
        ref_a8 = dm.reference_fp8_w8a8_matmul(x, w8, s).float()
        y_a8 = dm.fp8_w8a8_matmul(x, w8, s).float()
        torch.testing.assert_close(y_a8, ref_a8, rtol=2e-2, atol=2e-2 * ref_a8.abs().max().item())
