"""foundation.tensor_shapes: the tensor table a config implies matches what transformers, `compress
quantize` and `compress convert` write, and damaged tensors are named in one line."""
from __future__ import annotations

import pytest
import torch

from cli.main import main
from compress.quantize import quantize_checkpoint
from foundation.checkpoint import Checkpoint
from foundation.errors import CheckpointError
from foundation.quant_spec import QuantSpec
from foundation.schemes import (
    FP8_DYNAMIC,
    FP8_W8A16,
    W4A16,
    W4A16_ASYM,
    W8A8,
    W8A16,
    default_scheme,
)
from foundation.tensor_shapes import (
    LinearShape,
    ModelShapes,
    check_checkpoint,
    check_tensors,
    expected_tensors,
    linear_rules,
    no_quantization,
)
from tests.tiny_models import ARCHITECTURES, damaged_copy


def required(rules: dict) -> set[str]:
    return {n for n, r in rules.items() if not r.optional}


def shapes_and_schemes(ckpt: Checkpoint):
    qc = ckpt.quantization_config
    return ModelShapes.from_config(ckpt.config), QuantSpec.from_config(qc).scheme_for if qc else no_quantization


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_dense_table_is_exactly_what_transformers_saves(arch, tiny_checkpoints):
    ckpt = Checkpoint.open(tiny_checkpoints[arch])
    shapes, scheme_for = shapes_and_schemes(ckpt)
    rules = expected_tensors(shapes, scheme_for)
    assert required(rules) == set(ckpt.names())
    assert all(ckpt.shape(n) == r.shape for n, r in rules.items())
    assert ("lm_head.weight" in rules) == (arch != "gemma3_text")  # the tiny Gemma is tied
    assert check_checkpoint(ckpt, shapes, scheme_for) == []  # nothing unread either


@pytest.mark.parametrize("scheme", [default_scheme("int4"), W4A16, W4A16_ASYM, W8A16, FP8_DYNAMIC, FP8_W8A16, W8A8],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("ignore", [("lm_head",), ()], ids=["lm_head-dense", "lm_head-quantized"])
def test_quantized_table_is_exactly_what_quantize_writes(scheme, ignore, tiny_checkpoints, tmp_path):
    out = quantize_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "q", scheme, ignore=ignore, progress=False).out
    ckpt = Checkpoint.open(out)
    shapes, scheme_for = shapes_and_schemes(ckpt)
    rules = expected_tensors(shapes, scheme_for)
    assert required(rules) == set(ckpt.names())
    assert ("lm_head.weight_scale" in rules) == (not ignore)
    assert check_checkpoint(ckpt, shapes, scheme_for) == []  # nothing unread either


def test_kv_sharing_readers_have_no_kv_tensors(tiny_checkpoints, tmp_path):
    out = tmp_path / "shared"
    assert main(["convert", str(tiny_checkpoints["qwen3"]), "--mqa", "--merge", "mean", "--kv-share", "2",
                 "--eval-tokens", "0", "-o", str(out)]) == 0
    ckpt = Checkpoint.open(out)
    shapes, scheme_for = shapes_and_schemes(ckpt)
    rules = expected_tensors(shapes, scheme_for)
    assert "model.layers.1.self_attn.k_proj.weight" not in rules
    assert "model.layers.1.self_attn.k_norm.weight" not in rules
    assert rules["model.layers.0.self_attn.k_proj.weight"].shape == (32, 128)  # MQA: one KV head
    assert check_checkpoint(ckpt, shapes, scheme_for) == []  # nothing unread either


def test_every_problem_is_counted_and_the_first_named(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    bad = damaged_copy(src, tmp_path / "bad", drop=("model.layers.2.self_attn.v_proj.weight",),
                       put={"model.norm.weight": torch.zeros(128, dtype=torch.int32),
                            "model.layers.0.mlp.down_proj.weight": torch.zeros(128, 100)})
    ckpt = Checkpoint.open(bad)
    with pytest.raises(CheckpointError) as err:
        check_tensors(ckpt, expected_tensors(ModelShapes.from_config(ckpt.config), no_quantization))
    message = str(err.value)
    assert "\n" not in message
    assert message.endswith("model.layers.0.mlp.down_proj.weight has shape [128, 100], expected [128, 256] "
                            "(Linear intermediate_size -> hidden_size) (and 2 more problems)")


def test_a_group_that_does_not_divide_the_input_is_refused():
    linear = LinearShape("model.layers.0.mlp.down_proj", 128, 96, False, "intermediate_size -> hidden_size")
    with pytest.raises(CheckpointError, match="group size 64 of scheme W4A16 does not divide its 96 input features"):
        linear_rules(linear, W4A16)


def test_packed_layout_follows_the_scheme():
    linear = LinearShape("m", 100, 256, True, "x -> y")
    rules = linear_rules(linear, W4A16_ASYM)  # 8 values per int32, group 64
    assert {n: r.shape for n, r in rules.items()} == {
        "m.weight_packed": (100, 32), "m.weight_shape": (2,), "m.weight_zero_point": (13, 4),
        "m.weight_scale": (100, 4), "m.weight_g_idx": (256,), "m.bias": (100,),
    }
    assert rules["m.weight_shape"].contents == (100, 256) and rules["m.weight_g_idx"].optional
    assert linear_rules(linear, W8A16)["m.weight_packed"].shape == (100, 64)
    assert linear_rules(linear, FP8_DYNAMIC)["m.weight"].dtypes.allowed == ("F8_E4M3",)
    assert linear_rules(linear, W8A8)["m.weight_scale"].shape == (100, 1)
