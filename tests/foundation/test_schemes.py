"""Scheme presets serialise exactly as compressed-tensors' own models do."""
from __future__ import annotations

import pytest

from foundation.errors import KvslimError
from foundation.schemes import (
    FP8_DYNAMIC,
    FP8_W8A16,
    PRESETS,
    W4A16,
    W8A8,
    W8A16,
    default_scheme,
    scheme_from_config_group,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_group_is_compressed_tensors_model_dump(name):
    from compressed_tensors.quantization import (
        QuantizationScheme,
        preset_name_to_scheme,
    )

    scheme = PRESETS[name]
    ours = scheme.to_config_group()
    theirs = QuantizationScheme.model_validate(ours).model_dump()
    assert ours == theirs
    # Same fields as compressed-tensors' preset of that name; group size / strategy may differ
    # (the presets' group 128 does not divide the default model's 576 features).
    preset = preset_name_to_scheme(name, ["Linear"]).model_dump()
    for part in ("weights", "input_activations"):
        p, o = preset[part], ours[part]
        if p is None:
            assert o is None
            continue
        for key in ("num_bits", "type", "symmetric", "dynamic"):
            assert o[key] == p[key], (part, key)
    assert scheme_from_config_group(ours) == scheme


def test_fp8_weight_only_is_a_valid_compressed_tensors_group():
    """Not a preset: FP8_DYNAMIC's weights with no input_activations (vLLM's W8A16Fp8)."""
    from compressed_tensors.quantization import (
        QuantizationScheme,
        preset_name_to_scheme,
    )

    ours = FP8_W8A16.to_config_group()
    assert ours == QuantizationScheme.model_validate(ours).model_dump()
    assert ours["input_activations"] is None and ours["format"] == "float-quantized"
    assert ours["weights"] == preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).model_dump()["weights"]
    assert scheme_from_config_group(ours) == FP8_W8A16 == default_scheme("fp8-weight-only")


def test_with_options():
    assert W8A16.with_options(group_size=64).group_size == 64
    asym = W4A16.with_options(symmetric=False)
    assert asym.name == "W4A16_ASYM" and not asym.symmetric
    with pytest.raises(KvslimError):
        FP8_DYNAMIC.with_options(group_size=32)
    with pytest.raises(KvslimError):
        W4A16.with_options(group_size=0)


def test_group_check_names_the_layer():
    with pytest.raises(KvslimError, match="q_proj.*576"):
        W4A16.with_options(group_size=128).check_input_features(576, "q_proj")
    W4A16.with_options(group_size=64).check_input_features(576, "q_proj")


def test_defaults():
    assert default_scheme("fp8") is FP8_DYNAMIC
    assert default_scheme("int8") is W8A16
    assert default_scheme("w8a8") is W8A8
    int4 = default_scheme("int4")
    assert (int4.name, int4.group_size, int4.symmetric) == ("W4A16", 32, True)  # plain from_pretrained loads it
    int4.check_input_features(576, "q_proj")  # the default model's hidden size


def test_w8a8_is_compressed_tensors_preset_exactly():
    """Unlike the weight-only presets, W8A8 keeps every field of compressed-tensors' preset."""
    import torch
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import preset_name_to_scheme

    theirs = preset_name_to_scheme("W8A8", ["Linear"])
    ours = W8A8.to_config_group()
    assert {k: v for k, v in ours.items() if k != "format"} == {
        k: v for k, v in theirs.model_dump().items() if k != "format"}
    assert infer_module_format(torch.nn.Linear, theirs) == CompressionFormat(ours["format"]) == CompressionFormat.int_quantized
    assert not W8A8.is_packed and "dynamic per-token INT8 activations" in W8A8.describe()


def test_w8a8_takes_no_group_or_asymmetry():
    with pytest.raises(KvslimError, match="per-channel symmetric"):
        W8A8.with_options(group_size=32)
    with pytest.raises(KvslimError, match="per-channel symmetric"):
        W8A8.with_options(symmetric=False)
    assert W8A8.with_options(symmetric=True) is W8A8
    with pytest.raises(KvslimError, match="W8A8"):
        scheme_from_config_group({**W8A8.to_config_group(), "weights": {**W8A8.weights_config(), "num_bits": 4}})
