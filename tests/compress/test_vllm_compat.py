"""vLLM kernel-fit rules on the default model's shapes (hidden 576, intermediate 1536)."""
from __future__ import annotations

from compress.vllm_compat import fp8_scaled_mm, kernel_verdicts, machete, marlin
from foundation.schemes import FP8_DYNAMIC, W4A16, W4A16_ASYM, W8A16


def test_marlin_needs_input_multiple_of_128():
    assert not marlin(W4A16, 576, 576).ok  # q_proj / o_proj
    assert "in 576 % 128" in marlin(W4A16, 576, 1536).reason
    assert marlin(W4A16, 1536, 576).ok  # down_proj: 1536 = 12 x 128, 576 = 9 x 64
    assert not marlin(W4A16, 1536, 192 + 8).ok  # out not a multiple of 64


def test_marlin_group_and_zero_point_rules():
    assert marlin(W4A16.with_options(group_size=32), 1536, 576).ok
    assert not marlin(W4A16.with_options(group_size=256), 2048, 576).ok
    assert marlin(W4A16_ASYM, 1536, 576).ok  # uint4 with zero points
    assert not marlin(W8A16.with_options(symmetric=False), 1536, 576).ok  # no uint8 + zp
    assert marlin(W8A16, 1536, 576).ok


def test_machete_needs_output_multiple_of_128():
    assert machete(W4A16, 576, 1536).ok  # gate/up
    assert not machete(W4A16, 1536, 576).ok
    assert not machete(W4A16.with_options(group_size=32), 576, 1536).ok  # group 32 unsupported
    assert not machete(FP8_DYNAMIC, 576, 1536).ok


def test_fp8_alignment():
    assert fp8_scaled_mm(FP8_DYNAMIC, 576, 192).ok
    assert not fp8_scaled_mm(FP8_DYNAMIC, 100, 192).ok
    assert [v.kernel for v in kernel_verdicts(FP8_DYNAMIC, 576, 192)] == ["FP8 scaled_mm", "Marlin"]


def test_int8_w8a8_alignment():
    from compress.vllm_compat import int8_scaled_mm
    from foundation.schemes import W8A8

    assert int8_scaled_mm(W8A8, 576, 192).ok
    assert not int8_scaled_mm(W8A8, 576, 100).ok
    assert not int8_scaled_mm(W8A16, 576, 192).ok
    assert [v.kernel for v in kernel_verdicts(W8A8, 576, 192)] == ["INT8 scaled_mm"]
