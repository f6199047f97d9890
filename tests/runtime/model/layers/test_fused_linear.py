"""Fused q/k/v and gate/up projections equal the unfused Linears.

Tolerances (fixed up front): fp32 fused and unfused paths compute the same dot products in one
GEMM or several, so max |diff| <= 1e-5 x max |ref| per layer and <= 1e-5 on logits (O(1-10)).
bf16 kernel paths: max |diff| <= 1e-2 x max |ref| (bf16 rounding of the output).
"""
from __future__ import annotations

import pytest
import torch

from attention_variants.convert import ConvertSpec, convert
from compress.quantize import quantize_checkpoint
from foundation.schemes import PRESETS, W4A16
from runtime.model.layers.fused_linear import (
    FusedLinear,
    SeparateLinears,
    stack_linear_tensors,
)
from runtime.model.layers.linear import make_linear
from runtime.model.loader import load_model
from tests.runtime.hf_oracle import runtime_logits, single_thread  # noqa: F401
from tests.runtime.model.layers.test_linear import SCHEMES, _rel, _tensors

pytestmark = pytest.mark.usefixtures("single_thread")

SIZES = (64, 32, 32)  # q, k, v rows of a GQA layer (multiples of 16: the INT4 kernel applies)


def _dense(out: int, cols: int, seed: int) -> dict[str, torch.Tensor]:
    return {"weight": torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["dense", *sorted(SCHEMES)])
def test_stacked_linear_equals_separate_linears(name, dtype):
    scheme = None if name == "dense" else SCHEMES[name]
    parts = [(_dense(n, 256, i) if scheme is None else _tensors(scheme, out=n, seed=i)) for i, n in enumerate(SIZES)]
    parts = [{**p, "bias": torch.randn(n) * 0.1} for p, n in zip(parts, SIZES)]
    stacked = stack_linear_tensors(parts, scheme)
    fused = FusedLinear(make_linear("qkv", stacked, scheme, dtype), SIZES)
    separate = SeparateLinears([make_linear(f"p{i}", p, scheme, dtype) for i, p in enumerate(parts)])
    x = torch.randn(7, 256).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in zip(fused(x), separate(x), strict=True):
        assert got.shape == ref.shape
        assert _rel(got, ref) <= tol


def test_act_order_parts_with_different_column_orders_do_not_stack():
    parts = [_tensors(W4A16, out=32, act_order=True, seed=s) for s in (0, 1)]
    assert stack_linear_tensors(parts, W4A16) is None
    same = [_tensors(W4A16, out=32, act_order=True, seed=0)] * 2
    assert stack_linear_tensors(same, W4A16) is not None


def _ids(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_fused_equals_unfused(path, dtype: str = "float32", atol: float = 1e-5) -> None:
    fused, plain = load_model(path, dtype), load_model(path, dtype, fuse=False)
    for layer in fused.layers:
        assert isinstance(layer.mlp.gate_up_proj, FusedLinear)
    for layer in plain.layers:
        assert isinstance(layer.self_attn.qkv_proj, SeparateLinears)
    ids = _ids()
    diff = (runtime_logits(fused, ids, (10,)) - runtime_logits(plain, ids, (10,))).abs().max().item()
    assert diff <= atol, f"{path.name}: max |diff| {diff:.2e}"


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_fused_model_logits_equal_unfused(tiny_checkpoints, arch):
    _assert_fused_equals_unfused(tiny_checkpoints[arch])


def test_kv_readers_project_queries_only(tiny_checkpoints, tmp_path):
    out = convert(tiny_checkpoints["llama"], ConvertSpec(kv_share=2, merge="mean"), tmp_path / "share2").out
    model = load_model(out)
    for i, layer in enumerate(model.layers):
        proj = layer.self_attn.qkv_proj
        if model.spec.attention.layers[i].kv_source == i:
            assert isinstance(proj, FusedLinear) and len(proj.sizes) == 3
        else:
            assert isinstance(proj, SeparateLinears) and len(proj.linears) == 1
    _assert_fused_equals_unfused(out)


@pytest.mark.parametrize("name", ["W4A16_ASYM", "FP8_DYNAMIC", "W8A8"])
def test_fused_quantized_model_logits_equal_unfused(tiny_checkpoints, tmp_path, name):
    quant = quantize_checkpoint(tiny_checkpoints["llama"], tmp_path / name, PRESETS[name], progress=False).out
    _assert_fused_equals_unfused(quant)


def test_parts_with_different_input_widths_are_a_checkpoint_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from foundation.errors import CheckpointError
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:, :8]], dim=1)
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"k_proj.weight has shape \[64, 136\], expected \[64, 128\]"):
        load_model(ckpt)
