import pytest
import torch

from foundation import primitives, schemes
from foundation.errors import KvslimError
from runtime.kernels import dequant_matmul as dm
from runtime.kernels import dispatch


@pytest.mark.parametrize("scheme,expected", [
    (schemes.W4A16, dispatch.WeightScheme("int", 4, True)),
    (schemes.W4A16_ASYM, dispatch.WeightScheme("int", 4, False)),
    (schemes.W8A16, dispatch.WeightScheme("int", 8, True)),
    (schemes.FP8_DYNAMIC, dispatch.WeightScheme("float", 8, True, fp8_activations=True)),
])
def test_weight_scheme_from_our_config_groups(scheme, expected):
    assert dispatch.WeightScheme.from_scheme(scheme) == expected


def test_unsupported_scheme_is_a_one_line_error():
    with pytest.raises(KvslimError, match="no kernel"):
        dispatch.WeightScheme.from_scheme(schemes.W8A8)  # INT8 activations: torch._int_mm, no Triton kernel


@pytest.mark.parametrize("scheme", [schemes.W4A16_ASYM, schemes.W8A16, schemes.FP8_DYNAMIC])
def test_quantized_linear_cpu_path_is_the_reference(scheme):
    w = torch.randn(32, 128)
    scale, zp = primitives.compute_qparams(w, scheme)
    tensors = primitives.encode_linear(primitives.quantize(w, scale, zp, scheme), scale, zp, scheme)
    declared = dispatch.WeightScheme.from_scheme(scheme)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = dispatch.quantized_linear(x, declared, tensors, bias=torch.ones(32, dtype=torch.bfloat16))
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    dense = primitives.dequantize_linear(tensors, scheme).float()
    if declared.fp8_activations:
        expected = dm.reference_fp8_w8a8_matmul(x.reshape(6, 128), tensors["weight"], tensors["weight_scale"])
    else:
        expected = (x.reshape(6, 128).float() @ dense.t()).to(torch.bfloat16)
    torch.testing.assert_close(y.reshape(6, 32), expected + 1)


def test_quantized_linear_checks_declared_symmetry():
    w = torch.randn(8, 64)
    scheme = schemes.W4A16_ASYM
    scale, zp = primitives.compute_qparams(w, scheme)
    tensors = primitives.encode_linear(primitives.quantize(w, scale, zp, scheme), scale, zp, scheme)
    with pytest.raises(KvslimError, match="weight_zero_point is present"):
        dispatch.quantized_linear(torch.randn(1, 64), dispatch.WeightScheme("int", 4, True), tensors)




@pytest.mark.parametrize("scheme", [schemes.W4A16, schemes.W4A16_ASYM, schemes.W8A16, schemes.FP8_DYNAMIC])
def test_quantized_linear_agrees_with_the_runtime_layers(scheme):
    """Same numbers as the runtime core's dequantize-per-forward Linear (its numerical reference)."""
    from runtime.model.layers.linear import make_linear

    w = torch.randn(32, 128)
    scale, zp = primitives.compute_qparams(w, scheme)
    tensors = primitives.encode_linear(primitives.quantize(w, scale, zp, scheme), scale, zp, scheme)
    layer = make_linear("proj", tensors, scheme, torch.bfloat16, use_cpu_kernels=False)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    ours = dispatch.quantized_linear(x, dispatch.WeightScheme.from_scheme(scheme), tensors)
    # ours accumulates in fp32 from fp32 weights; the layer multiplies bf16 weights in bf16
    torch.testing.assert_close(ours.float(), layer(x).float(), rtol=2e-2, atol=2e-2 * ours.float().abs().max().item())


@pytest.mark.parametrize("scheme", [schemes.W4A16_ASYM, schemes.FP8_DYNAMIC])
def test_kernel_linear_module(device, scheme):
    from runtime.kernels.kernel_linear import KernelLinear

    w = torch.randn(32, 128)
    scale, zp = primitives.compute_qparams(w, scheme)
    tensors = primitives.encode_linear(primitives.quantize(w, scale, zp, scheme), scale, zp, scheme)
    layer = KernelLinear(tensors, scheme, bias=torch.ones(32)).to(device)
    dtype = torch.bfloat16 if scheme.input_activations or device.type == "cuda" else torch.float32
    x = torch.randn(3, 128, dtype=dtype, device=device)
    expected = dispatch.quantized_linear(x.cpu(), dispatch.WeightScheme.from_scheme(scheme), tensors) + 1
    torch.testing.assert_close(layer(x).cpu().float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.float().abs().max().item())
