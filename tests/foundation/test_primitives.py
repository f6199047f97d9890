"""Pack/unpack and quantize/dequantize, against compressed-tensors' own code and by properties."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from foundation import primitives as P
from foundation.schemes import FP8_DYNAMIC, W4A16, W4A16_ASYM, W8A16, QuantScheme

INT_SCHEMES = [
    W8A16,
    W8A16.with_options(group_size=32),
    W8A16.with_options(group_size=32, symmetric=False),
    W4A16,
    W4A16_ASYM,
    W4A16.with_options(group_size=32),
    W4A16_ASYM.with_options(group_size=128),
]
ALL_SCHEMES = [FP8_DYNAMIC, *INT_SCHEMES]


def ct_scheme(scheme: QuantScheme):
    from compressed_tensors.quantization import QuantizationScheme

    return QuantizationScheme.model_validate(scheme.to_config_group())


def ct_reference(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """What compressed-tensors' own observer math + compressor store for ``weight``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    cts = ct_scheme(scheme)
    out, cols = weight.shape
    g = cols if scheme.strategy == "channel" else scheme.group_size
    grouped = weight.reshape(out, cols // g, g)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), cts.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zp}
    return BaseCompressor.get_value_from_registry(scheme.format).compress(state, cts)


def random_weight(out: int, cols: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 0.05
    w[0, :8] = 0.0  # an all-zero stretch (eps scale path)
    w[1] += 0.03  # a shifted row (asymmetric zero point away from 0)
    return w.to(dtype)


@pytest.mark.parametrize("scheme", ALL_SCHEMES, ids=lambda s: f"{s.name}-g{s.group_size}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoding_matches_compressed_tensors(scheme, dtype):
    weight = random_weight(40, 128, 0, dtype)
    ours = P.encode_linear(*_rtn(weight, scheme), scheme)
    theirs = ct_reference(weight, scheme)
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype, name
        assert ours[name].shape == t.shape, name
        assert torch.equal(ours[name].view(torch.uint8) if t.dtype == P.FP8_DTYPE else ours[name],
                           t.view(torch.uint8) if t.dtype == P.FP8_DTYPE else t), name


def _rtn(weight, scheme):
    scale, zp = P.compute_qparams(weight, scheme)
    return P.quantize(weight, scale, zp, scheme), scale, zp


@pytest.mark.parametrize("scheme", ALL_SCHEMES, ids=lambda s: f"{s.name}-g{s.group_size}")
def test_dequantize_linear_matches_compressed_tensors_decompress(scheme):
    from compressed_tensors.compressors import BaseCompressor

    weight = random_weight(40, 128, 1)
    tensors = P.encode_linear(*_rtn(weight, scheme), scheme)
    theirs = BaseCompressor.get_value_from_registry(scheme.format).decompress(dict(tensors), ct_scheme(scheme))
    assert torch.equal(P.dequantize_linear(tensors, scheme), theirs["weight"])


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    rows=st.integers(1, 9),
    cols=st.integers(1, 70),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip_and_matches_library(bits, rows, cols, dim, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    values = torch.randint(lo, hi, (rows, cols), generator=g, dtype=torch.int8)
    packed = P.pack_int32(values, bits, packed_dim=dim)
    assert torch.equal(packed, pack_to_int32(values, bits, packed_dim=dim))
    size = values.shape[dim]
    assert torch.equal(P.unpack_int32(packed, bits, size, packed_dim=dim), values)
    assert torch.equal(unpack_from_int32(packed, bits, values.shape, packed_dim=dim), values)


def test_int4_nibble_order():
    # values -8..7 -> nibbles 0..15, first value in the lowest nibble
    values = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)
    word = int(P.pack_int32(values, 4)[0, 0]) & 0xFFFFFFFF
    assert word == 0xF_C_B_A_9_8_1_0


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(ALL_SCHEMES),
    rows=st.integers(1, 6),
    groups=st.integers(1, 4),
    scale=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**16),
)
def test_quantize_dequantize_error_bound(scheme, rows, groups, scale, seed):
    cols = groups * (scheme.group_size or 16)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * scale
    s, zp = P.compute_qparams(w, scheme)
    q = P.quantize(w, s, zp, scheme)
    deq = P.dequantize(q, s, zp, scheme)
    step = P._grouped(torch.ones_like(w), scheme) * s.unsqueeze(-1)
    err = P._grouped((deq - w).abs(), scheme)
    if scheme.type == "int":
        # Round to nearest: at most half a step. The range ends map at most half a step past
        # [q_min, q_max] (symmetric: max -> +7.5 / +127.5; asymmetric: the rounded zero point
        # shifts the range by <= 0.5), so clipping also costs at most half a step.
        assert bool((err <= step * 0.5 * (1 + 1e-4) + 1e-12).all())
    else:
        # FP8 E4M3 keeps 3 mantissa bits: relative error <= 2^-4 of |w| (normal range) or
        # half the smallest subnormal step (2^-10 of the scale) near zero.
        bound = P._grouped(w.abs(), scheme) * 2**-4 + step * 2**-10
        assert bool((err <= bound * 1.0001 + 1e-12).all())


def test_symmetric_int_errors_are_at_most_a_step():
    w = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    s, zp = P.compute_qparams(w, W8A16)
    assert zp is None and torch.allclose(s, torch.tensor([[1.0 / 127.5]]))
    deq = P.dequantize(P.quantize(w, s, zp, W8A16), s, zp, W8A16)
    assert (deq - w).abs().max() <= s.max()


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_along_dim0_of_a_single_column(bits):
    # [n, 1] transposes to a [1, n] tensor whose strides (1, 1) view() rejects: found by hypothesis.
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    values = torch.arange(32 // bits, dtype=torch.int8).reshape(-1, 1) - 2
    assert torch.equal(P.pack_int32(values, bits, packed_dim=0), pack_to_int32(values, bits, packed_dim=0))
