"""The CPU kernels are chosen from the CPU's features, once, at load: simulated feature sets."""
from __future__ import annotations

import pytest
import torch

from compress.quantize import quantize_checkpoint
from foundation.schemes import W4A16, W8A8, W8A16
from runtime.model.layers.activation_dtype import CpuFeatures
from runtime.model.layers.cpu_kernels import CpuKernelChoice
from runtime.model.layers.linear import linear_kernels
from runtime.model.loader import load_model

AVX2_ONLY = CpuFeatures(avx2=True, avx512=False, vnni=False, avx512_bf16=False, amx=False)
AVX512_NO_VNNI = CpuFeatures(avx2=True, avx512=True, vnni=False, avx512_bf16=False, amx=False)
AVX512_VNNI = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=False, amx=False)
SAPPHIRE_RAPIDS = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=True, amx=True)


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu_kernels")
    schemes = {"W8A8": W8A8, "W8A16": W8A16, "W4A16": W4A16.with_options(group_size=32)}
    return {n: quantize_checkpoint(tiny_llama, root / n, s, progress=False).out for n, s in schemes.items()}


@pytest.mark.parametrize("features,int8_gemm", [(AVX2_ONLY, False), (AVX512_NO_VNNI, False), (AVX512_VNNI, True),
                                                (SAPPHIRE_RAPIDS, True)])
def test_int8_gemm_only_with_vnni(quantized, features, int8_gemm):
    choice = CpuKernelChoice.choose(torch.float32, features)
    assert choice.int8_gemm is int8_gemm
    assert ("(VNNI)" if int8_gemm else "(no VNNI)") in choice.describe()
    model = load_model(quantized["W8A8"], "float32", cpu_features=features)
    assert model.cpu_kernels == choice
    expected = "torch._int_mm (INT8 GEMM)" if int8_gemm else "fake-quantize + dequantize + GEMM"
    assert linear_kernels(model) == {expected: 4 * 4, "dense GEMM": 1}  # qkv, o, gate_up, down x 4 layers; lm_head


@pytest.mark.parametrize("name,kernel", [("W4A16", "_weight_int4pack_mm_for_cpu (bf16)"),
                                         ("W8A16", "_weight_int8pack_mm (bf16)")])
def test_weight_only_kernels_follow_the_auto_dtype(quantized, name, kernel):
    native = load_model(quantized[name], "auto", cpu_features=SAPPHIRE_RAPIDS)
    assert native.dtype == torch.bfloat16 and native.cpu_kernels.weight_only_kernels
    assert linear_kernels(native) == {kernel: 16, "dense GEMM": 1}
    plain = load_model(quantized[name], "auto", cpu_features=AVX2_ONLY)
    assert plain.dtype == torch.float32 and not plain.cpu_kernels.weight_only_kernels
    assert linear_kernels(plain) == {"dequantize + GEMM": 16, "dense GEMM": 1}
    assert "dequantize + GEMM (fp32 activations)" in plain.cpu_kernels.describe()


def test_w8a8_paths_agree(quantized):
    """Without VNNI the reference path serves the same model (same tolerance as test_linear's)."""
    from tests.runtime.model.layers.test_linear import _w8a8_logits_close, runtime_logits

    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    fast = runtime_logits(load_model(quantized["W8A8"], "float32", cpu_features=AVX512_VNNI), ids, (10,))
    plain = runtime_logits(load_model(quantized["W8A8"], "float32", cpu_features=AVX2_ONLY), ids, (10,))
    _w8a8_logits_close(plain, fast)


def test_generate_stats_prints_the_choice(tiny_with_tokenizer, capsys):
    from cli.main import main

    assert main(["generate", str(tiny_with_tokenizer), "Hello", "--max-tokens", "2", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "cpu kernels: CPU AVX2: W8A8 via dequantize + GEMM (no VNNI)" in out  # conftest's CPU
    assert "linear kernels (one per GEMM; q/k/v and gate/up fused): dense GEMM x17" in out
