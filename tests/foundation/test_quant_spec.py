"""QuantSpec resolves each Linear's scheme as compressed-tensors does."""
from __future__ import annotations

import pytest

from compress.quantize import quantization_config
from foundation.quant_spec import QuantSpec
from foundation.schemes import W4A16, W8A16


@pytest.mark.parametrize("order", ["lm_head second", "lm_head first"])
def test_a_name_outranks_a_regex_outranks_the_class(order):
    groups = {"a": W4A16.to_config_group(("Linear",)), "b": W8A16.to_config_group(("lm_head",)),
              "c": W8A16.to_config_group(("re:.*down_proj",))}
    if order == "lm_head first":
        groups = dict(reversed(list(groups.items())))
    qc = {**quantization_config(W4A16, ()), "config_groups": groups}
    spec = QuantSpec.from_config(qc)
    assert spec.scheme_for("lm_head") == W8A16
    assert spec.scheme_for("model.layers.3.mlp.down_proj") == W8A16
    assert spec.scheme_for("model.layers.3.mlp.up_proj") == W4A16
    assert spec.main_group.targets == ("Linear",)


def test_ignore_wins_over_every_group():
    qc = quantization_config(W4A16, ("lm_head",), lm_head=W8A16)
    assert QuantSpec.from_config(qc).scheme_for("lm_head") is None
    assert qc["format"] == "pack-quantized" and set(qc["config_groups"]) == {"group_0", "group_1"}
