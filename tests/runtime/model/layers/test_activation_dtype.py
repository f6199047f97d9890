"""``dtype="auto"``: the activation dtype chosen from the CPU's features, once, for every runner."""
from __future__ import annotations

import pytest
import torch

from foundation.errors import KvslimError
from foundation.schemes import FP8_DYNAMIC, FP8_W8A16, W4A16, W8A8, W8A16
from runtime.model.layers.activation_dtype import CpuFeatures, choose_activation_dtype

DETECT = CpuFeatures.detect  # bound at collection, before the session fixture replaces it
NATIVE_BF16 = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=True, amx=False)
AVX2_ONLY = CpuFeatures(avx2=True, avx512=False, vnni=False, avx512_bf16=False, amx=False)
AMX = CpuFeatures(avx2=True, avx512=True, vnni=True, avx512_bf16=False, amx=True)
# bf16 keeps 8 mantissa bits (relative error 2^-8 per rounding); the tiny model's logits are O(1)
# and pass through 4 layers: a bound fixed before measuring.
BF16_LOGITS_ATOL = 0.1


@pytest.mark.parametrize("scheme", [W4A16, W8A16, FP8_W8A16, W8A8, FP8_DYNAMIC, None],
                         ids=lambda x: getattr(x, "name", "dense"))
def test_auto_is_bf16_exactly_on_a_native_bf16_cpu(scheme):
    schemes = () if scheme is None else (scheme,)
    storage = "dense weights" if scheme is None else scheme.name
    for features in (NATIVE_BF16, AMX):
        choice = choose_activation_dtype("auto", schemes, "cpu", features)
        assert choice.dtype == torch.bfloat16
        assert choice.reason == f"auto: {storage} on a CPU with native bf16 ({features.describe()})"
    plain = choose_activation_dtype("auto", schemes, "cpu", AVX2_ONLY)
    assert plain.dtype == torch.float32 and plain.reason == f"auto: {storage} on a CPU without native bf16 (AVX2)"


def test_auto_on_cuda_is_bf16_and_explicit_always_wins():
    assert choose_activation_dtype("auto", (), "cuda", AVX2_ONLY).dtype == torch.bfloat16
    for features in (NATIVE_BF16, AVX2_ONLY):
        choice = choose_activation_dtype("float32", (W4A16,), "cpu", features)
        assert choice.dtype == torch.float32 and choice.reason == "requested"
    assert choose_activation_dtype(torch.float16, (), "cpu", NATIVE_BF16).dtype == torch.float16


@pytest.mark.parametrize("bad", ["fp32", "int8", torch.float64])
def test_unknown_dtype_is_one_line(bad):
    with pytest.raises(KvslimError, match="is not supported") as e:
        choose_activation_dtype(bad)
    assert "\n" not in str(e.value)


def test_detect_reads_this_cpu():
    real = DETECT()  # the suite replaces detect (see tests/conftest.py); this is the original
    assert isinstance(real.native_bf16, bool) and real.describe()
    assert real.avx2 or not real.avx512  # every AVX-512 CPU has AVX2


def test_llm_auto_on_a_native_bf16_cpu_takes_the_bf16_int4_kernel(tiny_llama, tmp_path, monkeypatch):
    from compress.quantize import quantize_checkpoint
    from foundation.schemes import W4A16
    from runtime.llm import LLM
    from runtime.model.layers.linear import Int4PackLinear

    out = quantize_checkpoint(tiny_llama, tmp_path / "int4", W4A16.with_options(group_size=32), progress=False).out
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: NATIVE_BF16))
    auto = LLM(out)
    assert auto.dtype == torch.bfloat16 and auto.activation_dtype.reason.startswith("auto: W4A16 on a CPU with native bf16")
    assert any(isinstance(m, Int4PackLinear) for m in auto.model.modules())
    reference = LLM(out, dtype="float32")
    ids = [5, 17, 300, 42, 7, 9, 11]
    assert (auto.score(ids) - reference.score(ids)).abs().max() < BF16_LOGITS_ATOL


def test_generate_stats_names_the_choice(tiny_with_tokenizer, capsys):
    from cli.main import main

    assert main(["generate", str(tiny_with_tokenizer), "Hello", "--max-tokens", "2", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "activations: float32 (auto: dense weights on a CPU without native bf16 (AVX2))" in out  # conftest's CPU
    assert main(["generate", str(tiny_with_tokenizer), "Hello", "--max-tokens", "2", "--stats",
                 "--dtype", "bfloat16"]) == 0
    assert "activations: bfloat16 (requested)" in capsys.readouterr().out
