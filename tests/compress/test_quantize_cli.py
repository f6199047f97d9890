"""`compress quantize` / `compress inspect` through the CLI entry point, good and bad input."""
from __future__ import annotations

import json
import shutil

import pytest

from cli.main import main
from compress.quantize import quantization_config
from foundation.checkpoint import Checkpoint
from foundation.schemes import FP8_DYNAMIC, FP8_W8A16, W4A16_ASYM, W8A8, W8A16


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        rc = int(e.code)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]


def test_quantize_int4_writes_checkpoint_and_table(tiny_llama, tmp_path, capsys):
    out = tmp_path / "q"
    rc, stdout, _ = run_cli(capsys, "quantize", str(tiny_llama), "--int4", "--group-size", "32", "-o", str(out),
                            "--no-progress")
    assert rc == 0
    assert "scheme: W4A16 (INT4 group 32 symmetric" in stdout and "x vs bf16" in stdout and "total" in stdout
    assert "note:" not in stdout
    ckpt = Checkpoint.open(out)
    qc = ckpt.quantization_config
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is True
    assert ckpt.headers["model.layers.0.self_attn.q_proj.weight_packed"] == ("I32", (128, 16))
    assert "model.layers.0.self_attn.q_proj.weight_zero_point" not in ckpt.headers
    assert ckpt.headers["model.layers.0.self_attn.q_proj.weight_scale"] == ("F32", (128, 4))
    assert ckpt.headers["model.embed_tokens.weight"] == ("F32", (512, 128))  # source dtype kept
    assert (out / "generation_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_asymmetric_int4_names_the_loading_route_that_works(tiny_llama, tmp_path, capsys):
    out = tmp_path / "asym"
    rc, stdout, _ = run_cli(capsys, "quantize", str(tiny_llama), "--int4", "--asymmetric", "--group-size", "32",
                            "-o", str(out), "--no-progress")
    assert rc == 0 and "W4A16_ASYM" in stdout
    assert "note: W4A16_ASYM stores packed zero points" in stdout and "CompressedTensorsConfig(dequantize=True)" in stdout
    assert Checkpoint.open(out).headers["model.layers.0.self_attn.q_proj.weight_zero_point"] == ("I32", (16, 4))
    rc, stdout, _ = run_cli(capsys, "inspect", str(out))
    assert rc == 0 and "warning: W4A16_ASYM stores packed zero points" in stdout


def test_quantize_fp8_and_int8_formats(tiny_llama, tmp_path, capsys):
    rc, _, _ = run_cli(capsys, "quantize", str(tiny_llama), "--fp8", "-o", str(tmp_path / "f"), "--no-progress")
    assert rc == 0
    ckpt = Checkpoint.open(tmp_path / "f")
    assert ckpt.quantization_config["format"] == "float-quantized"
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight"] == ("F8_E4M3", (128, 256))
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight_scale"] == ("F32", (128, 1))
    rc, _, _ = run_cli(capsys, "quantize", str(tiny_llama), "--int8", "-o", str(tmp_path / "i"), "--no-progress")
    assert rc == 0
    ckpt = Checkpoint.open(tmp_path / "i")
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight_packed"] == ("I32", (128, 64))
    assert "model.layers.0.mlp.down_proj.weight_zero_point" not in ckpt.headers


def test_quantize_w8a8_format_and_inspect(tiny_llama, tmp_path, capsys):
    rc, stdout, _ = run_cli(capsys, "quantize", str(tiny_llama), "--w8a8", "-o", str(tmp_path / "w"), "--no-progress")
    assert rc == 0 and "W8A8" in stdout
    ckpt = Checkpoint.open(tmp_path / "w")
    qc = ckpt.quantization_config
    assert qc["format"] == "int-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"]["type"] == "int"
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight"] == ("I8", (128, 256))
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight_scale"] == ("F32", (128, 1))
    assert not any(n.endswith(("weight_packed", "weight_zero_point")) for n in ckpt.names())
    rc, stdout, _ = run_cli(capsys, "inspect", str(tmp_path / "w"))
    assert rc == 0
    assert "W8A8" in stdout and "int-quantized" in stdout and "dynamic per-token INT8 activations" in stdout
    assert "INT8 scaled_mm" in stdout


def test_quantize_fp8_weight_only(tiny_llama, tmp_path, capsys):
    rc, stdout, _ = run_cli(capsys, "quantize", str(tiny_llama), "--fp8-weight-only", "-o", str(tmp_path / "f"),
                            "--no-progress")
    assert rc == 0 and "FP8_W8A16" in stdout and "weight-only" in stdout
    ckpt = Checkpoint.open(tmp_path / "f")
    group = ckpt.quantization_config["config_groups"]["group_0"]
    assert group["input_activations"] is None and group["weights"]["type"] == "float"
    assert ckpt.headers["model.layers.0.mlp.down_proj.weight"] == ("F8_E4M3", (128, 256))
    rc, stdout, _ = run_cli(capsys, "inspect", str(tmp_path / "f"))
    assert rc == 0 and "Marlin" in stdout


@pytest.mark.parametrize("scheme", [FP8_DYNAMIC, FP8_W8A16, W8A8, W8A16, W4A16_ASYM], ids=lambda s: s.name)
def test_quantization_config_is_what_compressed_tensors_writes(scheme, tmp_path):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ours = quantization_config(scheme, ("lm_head",))
    (tmp_path / "config.json").write_text("{}")
    ct = QuantizationConfig.model_validate({k: v for k, v in ours.items() if k not in
                                            ("version", "sparsity_config", "transform_config")})
    ModelCompressor(quantization_config=ct).update_config(str(tmp_path))
    theirs = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert ours == theirs


def test_untied_lm_head_is_quantized_when_not_ignored(tiny_llama, tmp_path, capsys):
    rc, _, _ = run_cli(capsys, "quantize", str(tiny_llama), "--int8", "--ignore", "model.layers.0.mlp.down_proj",
                       "-o", str(tmp_path / "q"), "--no-progress")
    assert rc == 0
    ckpt = Checkpoint.open(tmp_path / "q")
    assert "lm_head.weight_packed" in ckpt.headers
    assert "model.layers.0.mlp.down_proj.weight" in ckpt.headers
    assert ckpt.quantization_config["ignore"] == ["model.layers.0.mlp.down_proj"]


def test_inspect_quantized(tiny_llama, tmp_path, capsys):
    run_cli(capsys, "quantize", str(tiny_llama), "--int4", "--group-size", "32", "-o", str(tmp_path / "q"),
            "--no-progress")
    rc, stdout, _ = run_cli(capsys, "inspect", str(tmp_path / "q"))
    assert rc == 0
    assert "LlamaForCausalLM" in stdout and "4 heads x 32, 2 KV heads" in stdout
    assert "W4A16 " in stdout and "pack-quantized" in stdout and "warning:" not in stdout
    assert "I32" in stdout and "Marlin" in stdout and "Machete" in stdout
    # 4 layers x 2 KV heads x 32 x (K+V) x 2 bytes = 1 KiB per token in bf16
    assert "bf16 1.00 KiB, fp8 0.50 KiB" in stdout


def test_inspect_sliding_gemma(tiny_checkpoints, capsys):
    rc, stdout, _ = run_cli(capsys, "inspect", str(tiny_checkpoints["gemma3_text"]))
    assert rc == 0
    assert "sliding window 16 on 3 layers [0, 1, 2]" in stdout
    assert "quantization: none" in stdout and "tied embeddings" in stdout


def test_inspect_names_the_sinks(tiny_checkpoints, tmp_path, capsys):
    from attention_variants.convert import ConvertSpec, convert

    out = convert(tiny_checkpoints["gemma3_text"], ConvertSpec(sinks=4), tmp_path / "sinks").out
    rc, stdout, _ = run_cli(capsys, "inspect", str(out))
    assert rc == 0 and "sliding window 16 + 4 attention sinks on 3 layers [0, 1, 2]" in stdout


# --- bad input: one line on stderr, exit 2, nothing written ----------------------------------
def test_missing_path(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "quantize", str(tmp_path / "nope"), "--int4", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "no such file or directory")
    assert not (tmp_path / "o").exists()


def test_dir_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, "quantize", str(tmp_path / "empty"), "--fp8", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "no config.json")
    assert not (tmp_path / "o").exists()


def test_truncated_safetensors(tiny_llama, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rc, _, err = run_cli(capsys, "quantize", str(bad), "--int8", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "truncated")
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(tiny_llama, tmp_path, capsys):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_cli(capsys, "quantize", str(bad), "--int4", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "GPT2LMHeadModel")
    assert not (tmp_path / "o").exists()


def test_conflicting_flags(tiny_llama, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "quantize", str(tiny_llama), "--fp8", "--int4", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "not allowed with argument")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, needle", [
    (["--int4", "--group-size", "48"], "does not divide"),
    (["--int4", "--group-size", "0"], "must be positive"),
    (["--fp8", "--group-size", "32"], "FP8 weights are per-channel"),
    (["--fp8", "--asymmetric"], "symmetric only"),
    (["--w8a8", "--group-size", "64"], "per-channel symmetric"),
    (["--w8a8", "--asymmetric"], "per-channel symmetric"),
    (["--int4", "--ignore", "model.layers.9.mlp.up_proj"], "matches no Linear"),
    (["--int4", "--ignore", "re:("], "not a valid regular expression"),
])
def test_impossible_options(args, needle, tiny_llama, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "quantize", str(tiny_llama), *args, "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, needle)
    assert not (tmp_path / "o").exists()


def test_tied_lm_head_cannot_be_quantized(tiny_checkpoints, tmp_path, capsys):
    rc, _, err = run_cli(capsys, "quantize", str(tiny_checkpoints["gemma3_text"]), "--int8", "--ignore",
                         "model.layers.0.mlp.up_proj", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "tied")


def test_existing_output_needs_force(tiny_llama, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "quantize", str(tiny_llama), "--int8", "-o", str(out))
    assert_one_line_error(rc, err, "already exists")
    assert (out / "keep.txt").read_text() == "mine"
    rc, _, _ = run_cli(capsys, "quantize", str(tiny_llama), "--int8", "-o", str(out), "--force", "--no-progress")
    assert rc == 0 and not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_already_quantized_input(tiny_llama, tmp_path, capsys):
    run_cli(capsys, "quantize", str(tiny_llama), "--int8", "-o", str(tmp_path / "q"), "--no-progress")
    rc, _, err = run_cli(capsys, "quantize", str(tmp_path / "q"), "--int4", "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "already quantized")


def test_inspect_bad_input(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "inspect", str(tmp_path / "nope"))
    assert_one_line_error(rc, err, "no such file")
