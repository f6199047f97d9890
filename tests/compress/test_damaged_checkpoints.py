"""`compress inspect` and `compress quantize` on damaged checkpoints: a missing, misshapen,
mistyped or unknown tensor is one stderr line and exit 2, and quantize writes nothing."""
from __future__ import annotations

import pytest
import torch

from cli.main import main
from compress.quantize import quantize_checkpoint
from foundation.schemes import FP8_DYNAMIC, W8A16, default_scheme
from tests.tiny_models import damaged_copy


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory) -> dict:
    """The tiny Llama in INT4 (the default), INT4 asymmetric (packed zero points), INT8 (packed) and FP8."""
    root = tmp_path_factory.mktemp("quantized")
    schemes = {"int4": default_scheme("int4"), "int4_asym": default_scheme("int4").with_options(symmetric=False),
               "int8": W8A16, "fp8": FP8_DYNAMIC}
    return {k: quantize_checkpoint(tiny_checkpoints["llama"], root / k, s, progress=False).out
            for k, s in schemes.items()}


def source_of(kind, tiny_checkpoints, quantized):
    return tiny_checkpoints["llama"] if kind == "dense" else quantized[kind]


LAYER = "model.layers.2.self_attn.v_proj"
DOWN = "model.layers.3.mlp.down_proj"


@pytest.mark.parametrize("kind, drop, put, needle", [
    ("dense", (f"{LAYER}.weight",), {}, f"missing tensor {LAYER}.weight"),
    ("dense", (), {f"{DOWN}.weight": torch.zeros(128, 100)},
     f"{DOWN}.weight has shape [128, 100], expected [128, 256] (Linear intermediate_size -> hidden_size)"),
    ("dense", (), {"model.norm.weight": torch.zeros(128, dtype=torch.int32)},
     "model.norm.weight has dtype I32, expected a floating-point dtype: F32, BF16, F16 or F64"),
    ("dense", ("lm_head.weight",), {}, "missing tensor lm_head.weight"),
    ("int4", (f"{LAYER}.weight_packed",), {}, f"missing tensor {LAYER}.weight_packed"),
    ("int4_asym", (), {f"{DOWN}.weight_zero_point": torch.zeros(16, 4, dtype=torch.int32)},
     f"{DOWN}.weight_zero_point has shape [16, 4], expected [16, 8] (packed zero points of W4A16_ASYM"),
    ("int4", (), {f"{DOWN}.weight_shape": torch.tensor([128, 200])},
     f"{DOWN}.weight_shape holds [128, 200], expected [128, 256]"),
    ("int8", (), {f"{DOWN}.weight_packed": torch.zeros(125, 64, dtype=torch.int32)},
     f"{DOWN}.weight_packed has shape [125, 64], expected [128, 64] (W8A16 Linear"),
    ("int8", (), {f"{DOWN}.weight_packed": torch.zeros(128, 64)},
     f"{DOWN}.weight_packed has dtype F32, expected I32"),
    ("fp8", (), {f"{DOWN}.weight_scale": torch.ones(128)},
     f"{DOWN}.weight_scale has shape [128], expected [128, 1] (scales of FP8_DYNAMIC Linear"),
], ids=["missing-linear", "misshapen", "int32-norm", "untied-without-lm_head",
        "int4-missing", "int4-zero-point", "int4-weight_shape", "int8-rows-cut", "int8-float-packed", "fp8-scale"])
def test_inspect_refuses_damage(kind, drop, put, needle, tiny_checkpoints, quantized, tmp_path, capsys):
    bad = damaged_copy(source_of(kind, tiny_checkpoints, quantized), tmp_path / "bad", drop, put)
    assert_one_line_error(*run_cli(capsys, "inspect", str(bad)), needle)


@pytest.mark.parametrize("name, shape", [("model.extra.weight", (3,)), (f"{DOWN}.bias", (128,)),
                                         (f"{DOWN}.input_scale", (1,))], ids=["unknown", "unexpected-bias", "input_scale"])
def test_inspect_lists_tensors_the_runtime_does_not_read(name, shape, tiny_checkpoints, tmp_path, capsys):
    odd = damaged_copy(tiny_checkpoints["llama"], tmp_path / "odd", put={name: torch.zeros(shape)})
    assert main(["inspect", str(odd)]) == 0  # other loaders may read it: reported, not refused
    assert f"not read by the kvslim runtime (it refuses to load them; other loaders may use them): {name}" \
        in capsys.readouterr().out


def test_inspect_passes_an_intact_quantized_checkpoint(quantized, capsys):
    assert main(["inspect", str(quantized["int4"])]) == 0
    assert "(28 quantized Linears)" in capsys.readouterr().out  # 4 layers x 7; lm_head kept dense


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
                                  "model.layers.0.self_attn.rotary_emb.inv_freq"])
def test_inspect_accepts_tensors_unused_by_design(name, tiny_checkpoints, tmp_path, capsys):
    ok = damaged_copy(tiny_checkpoints["llama"], tmp_path / "ok", put={name: torch.ones(())})
    assert main(["inspect", str(ok)]) == 0


@pytest.mark.parametrize("with_lm_head", [False, True], ids=["tied-without-lm_head", "tied-with-lm_head"])
def test_tied_model_may_or_may_not_carry_lm_head(with_lm_head, tiny_checkpoints, tmp_path, capsys):
    src = tiny_checkpoints["gemma3_text"]  # tied
    put = {"lm_head.weight": torch.zeros(512, 128)} if with_lm_head else {}
    ckpt = damaged_copy(src, tmp_path / "tied", put=put)
    assert main(["inspect", str(ckpt)]) == 0
    assert main(["quantize", str(ckpt), "--int8", "-o", str(tmp_path / "q"), "--no-progress"]) == 0
    assert main(["inspect", str(tmp_path / "q")]) == 0


def test_kv_sharing_model_passes_inspect_and_quantize(tiny_checkpoints, tmp_path, capsys):
    shared = tmp_path / "shared"
    assert main(["convert", str(tiny_checkpoints["llama"]), "--kv-heads", "1", "--merge", "mean",
                 "--kv-share", "2", "--eval-tokens", "0", "-o", str(shared)]) == 0
    assert main(["inspect", str(shared)]) == 0
    assert main(["quantize", str(shared), "--int4", "-o", str(tmp_path / "q"), "--no-progress"]) == 0
    assert main(["inspect", str(tmp_path / "q")]) == 0


@pytest.mark.parametrize("drop, put, needle", [
    ((f"{LAYER}.weight",), {}, f"missing tensor {LAYER}.weight"),
    ((), {f"{DOWN}.weight": torch.zeros(100, 256)}, f"{DOWN}.weight has shape [100, 256], expected [128, 256]"),
    ((), {"model.layers.0.input_layernorm.weight": torch.zeros(64)},
     "model.layers.0.input_layernorm.weight has shape [64], expected [128] (norm over hidden_size)"),
], ids=["missing-linear", "misshapen-linear", "misshapen-norm"])
@pytest.mark.parametrize("flags", [["--int8"], ["--int4", "--method", "gptq"]], ids=["rtn", "gptq"])
def test_quantize_refuses_a_damaged_source_before_writing(drop, put, needle, flags, tiny_checkpoints, tmp_path,
                                                          capsys):
    bad = damaged_copy(tiny_checkpoints["llama"], tmp_path / "src", drop, put)
    out = tmp_path / "out"
    assert_one_line_error(*run_cli(capsys, "quantize", str(bad), *flags, "-o", str(out), "--no-progress"), needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temp dir


def test_quantize_library_call_refuses_before_writing(tiny_checkpoints, tmp_path):
    from foundation.errors import CheckpointError

    bad = damaged_copy(tiny_checkpoints["llama"], tmp_path / "src", drop=(f"{LAYER}.weight",))
    with pytest.raises(CheckpointError, match=f"missing tensor {LAYER}.weight"):
        quantize_checkpoint(bad, tmp_path / "out", W8A16, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
