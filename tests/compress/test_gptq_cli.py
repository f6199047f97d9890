"""`compress quantize --method gptq / --kv-cache-fp8` from the command line: a small end-to-end run
and bad input (one line, exit 2, nothing written)."""
from __future__ import annotations

import json

import pytest
import torch

from cli.main import main
from foundation.checkpoint import Checkpoint


def test_gptq_cli_end_to_end(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "g"
    rc = main(["quantize", str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--act-order",
               "--num-calib-samples", "4", "--calib-seq-len", "64", "--kv-cache-fp8", "-o", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "4 x 64 tokens of wikipedia:calib" in stdout and "gptq" in stdout
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    assert Checkpoint.open(out).has("model.layers.3.self_attn.v_scale")


def test_calibration_from_a_text_file(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    rc = main(["quantize", str(tiny_with_tokenizer), "--fp8", "--kv-cache-fp8", "--calib", str(text),
               "--num-calib-samples", "2", "--calib-seq-len", "32", "-o", str(tmp_path / "o"), "--no-progress"])
    assert rc == 0


def bad(args: list[str], out, capsys) -> str:
    rc = main(["quantize", *args, "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "\n" not in err and err.startswith("compress")
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}.tmp") for p in out.parent.iterdir())
    return err


def test_calibration_text_too_short(tiny_with_tokenizer, tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("Only a few words of calibration text.")
    err = bad([str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--calib", str(text),
               "--num-calib-samples", "4", "--calib-seq-len", "64"], tmp_path / "o", capsys)
    assert "need 256" in err


def test_named_range_too_short_for_request(tiny_with_tokenizer, tmp_path, capsys):
    err = bad([str(tiny_with_tokenizer), "--fp8", "--kv-cache-fp8", "--num-calib-samples", "100000",
               "--calib-seq-len", "512"], tmp_path / "o", capsys)
    assert "wikipedia:calib has" in err


def test_missing_calibration_file(tiny_with_tokenizer, tmp_path, capsys):
    err = bad([str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--calib", str(tmp_path / "nope.txt")],
              tmp_path / "o", capsys)
    assert "not found" in err


def test_evaluation_range_refused_for_calibration(tiny_with_tokenizer, tmp_path, capsys):
    err = bad([str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--calib", "wikipedia:eval"],
              tmp_path / "o", capsys)
    assert "eval range" in err


def test_cli_act_order_changes_the_weights(tiny_with_tokenizer, tmp_path):
    outs = {}
    for name, extra in (("plain", []), ("ordered", ["--act-order"])):
        outs[name] = tmp_path / name
        assert main(["quantize", str(tiny_with_tokenizer), "--fp8", "--method", "gptq", *extra, "--num-calib-samples",
                     "4", "--calib-seq-len", "64", "-o", str(outs[name]), "--no-progress"]) == 0
    plain, ordered = Checkpoint.open(outs["plain"]), Checkpoint.open(outs["ordered"])
    weights = [n for n in plain.names() if n.endswith(".weight") and plain.get(n).dtype == torch.float8_e4m3fn]
    assert weights and any(not torch.equal(plain.get(n).float(), ordered.get(n).float()) for n in weights)
    qc = json.loads((outs["ordered"] / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"


def test_int4_gptq_defaults_to_act_order_and_mse(tiny_with_tokenizer, tmp_path, capsys):
    def run(name: str, extra: list[str]) -> tuple[str, dict]:
        out = tmp_path / name
        assert main(["quantize", str(tiny_with_tokenizer), "--int4", "--method", "gptq", *extra, "--num-calib-samples",
                     "2", "--calib-seq-len", "32", "-o", str(out), "--no-progress"]) == 0
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        return capsys.readouterr().out, qc["config_groups"]["group_0"]["weights"]

    stdout, weights = run("default", [])
    assert "act-order, mse observer" in stdout and weights["actorder"] == "weight"
    stdout, weights = run("plain", ["--no-act-order", "--observer", "minmax"])
    assert "act-order" not in stdout and "minmax observer" in stdout and weights.get("actorder") is None


def test_fp8_gptq_defaults_to_plain_order_and_minmax(tiny_with_tokenizer, tmp_path, capsys):
    assert main(["quantize", str(tiny_with_tokenizer), "--fp8", "--method", "gptq", "--num-calib-samples", "2",
                 "--calib-seq-len", "32", "-o", str(tmp_path / "f"), "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert "act-order" not in stdout and "minmax observer" in stdout
    assert "inputs as served (dynamic per-token FP8 activations)" in stdout


@pytest.mark.parametrize("kind,acts", [("--fp8", "float"), ("--w8a8", "int"), ("--int4", None)])
def test_calibration_applies_the_served_activation_quantization(kind, acts, tiny_with_tokenizer, tmp_path, monkeypatch):
    """FP8_DYNAMIC and W8A8 calibrate on the quantized inputs they are served; weight-only schemes
    on plain inputs."""
    import compress.sequential_quantizer as sequential_quantizer

    seen = []
    real = sequential_quantizer.windows_quantizer
    monkeypatch.setattr(sequential_quantizer, "windows_quantizer",
                        lambda *a, **kw: seen.append(kw.get("activations")) or real(*a, **kw))
    assert main(["quantize", str(tiny_with_tokenizer), kind, "--method", "gptq", "--num-calib-samples", "2",
                 "--calib-seq-len", "32", "-o", str(tmp_path / "a"), "--no-progress"]) == 0
    assert (seen[0].type if seen[0] is not None else None) == acts


@pytest.mark.parametrize("flags,needle", [
    (["--int4", "--act-order"], "add --method gptq"),
    (["--int4", "--no-act-order"], "add --method gptq"),
    (["--int4", "--dampening", "0.1"], "add --method gptq"),
    (["--int4", "--observer", "mse"], "add --method gptq"),
    (["--int4", "--num-calib-samples", "8"], "needs calibration"),
    (["--int4", "--method", "gptq", "--dampening", "2"], "dampening"),
    (["--int4", "--method", "gptq", "--num-calib-samples", "0"], "positive"),
])
def test_bad_flags(flags, needle, tiny_with_tokenizer, tmp_path, capsys):
    assert needle in bad([str(tiny_with_tokenizer), *flags], tmp_path / "o", capsys)


def test_gptq_w8a8_writes_int_quantized(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "w"
    rc = main(["quantize", str(tiny_with_tokenizer), "--w8a8", "--method", "gptq", "--num-calib-samples", "2",
               "--calib-seq-len", "32", "-o", str(out), "--no-progress"])
    assert rc == 0 and "W8A8" in capsys.readouterr().out
    ckpt = Checkpoint.open(out)
    assert ckpt.quantization_config["format"] == "int-quantized"
    assert ckpt.headers["model.layers.0.self_attn.q_proj.weight"][0] == "I8"


def test_gptq_with_bf16_output_dtype(tiny_with_tokenizer, tmp_path, capsys):
    """GPTQ calibrates through the fp32 source while quantizing its bf16 cast: scales and the
    unquantized tensors come out bf16, and the summary says so."""
    out = tmp_path / "b"
    assert main(["quantize", str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--dtype", "bfloat16",
                 "--num-calib-samples", "2", "--calib-seq-len", "32", "-o", str(out), "--no-progress"]) == 0
    assert "cast to bfloat16 (source: float32)" in capsys.readouterr().out
    ckpt = Checkpoint.open(out)
    assert ckpt.get("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.bfloat16
    assert ckpt.get("model.embed_tokens.weight").dtype == torch.bfloat16
