"""Scale tuning (`compress.scale_tuning`): it lowers the KL to the original on the tuning windows
and on held-out windows, changes only ``weight_scale`` tensors, and bad input is refused."""
from __future__ import annotations

import pytest
import torch

from cli.main import main
from compress.quantize import quantize_checkpoint
from compress.scale_tuning import ScaleTuningSpec, tune_scales
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.schemes import default_scheme
from tests.compress.calib_tokens import zipf_ids


def _kl(student_dir, teacher_dir, ids) -> float:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(
        student_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        t = torch.log_softmax(teacher(input_ids=ids).logits, -1).flatten(0, 1)
        s = torch.log_softmax(student(input_ids=ids).logits, -1).flatten(0, 1)
    return float(torch.nn.functional.kl_div(s, t, log_target=True, reduction="batchmean"))


@pytest.mark.parametrize(("kind", "lr"), [("int4", 1e-2), ("int8", 1e-3)])
def test_tuning_lowers_kl_and_touches_only_scales(tiny_llama, tmp_path, kind, lr):
    scheme = default_scheme(kind)
    out = quantize_checkpoint(tiny_llama, tmp_path / "q", scheme, progress=False).out
    before = Checkpoint.open(out)
    stored = {n: before.get(n) for n in before.names()}
    calib, held_out = zipf_ids(8, 32, seed=0), zipf_ids(4, 32, seed=1)
    kl_calib, kl_held = _kl(out, tiny_llama, calib), _kl(out, tiny_llama, held_out)
    report = tune_scales(tiny_llama, out, calib, ScaleTuningSpec(steps=20, learning_rate=lr), progress=False)
    assert report.steps == 20 and report.kl_first > 0
    assert _kl(out, tiny_llama, calib) < kl_calib
    assert _kl(out, tiny_llama, held_out) < kl_held
    after = Checkpoint.open(out)
    assert after.names() == before.names()
    changed = [n for n in after.names() if not torch.equal(after.get(n), stored[n])]
    assert changed and all(n.endswith(".weight_scale") for n in changed)
    assert all(after.get(n).dtype == stored[n].dtype for n in changed)


def test_refuses_schemes_that_quantize_activations(tiny_llama, tmp_path):
    out = quantize_checkpoint(tiny_llama, tmp_path / "q", default_scheme("fp8"), progress=False).out
    with pytest.raises(KvslimError, match="weight-only"):
        tune_scales(tiny_llama, out, zipf_ids(2, 16, seed=0), ScaleTuningSpec(steps=1), progress=False)


def test_spec_rejects_nonpositive_steps():
    with pytest.raises(KvslimError, match="--tune-scales-steps"):
        ScaleTuningSpec(steps=0)


def test_cli_tunes_after_gptq(tiny_with_tokenizer, tmp_path, capsys):
    rc = main(["quantize", str(tiny_with_tokenizer), "--int4", "--method", "gptq", "--num-calib-samples", "4",
               "--calib-seq-len", "32", "--tune-scales-steps", "2", "-o", str(tmp_path / "t"), "--no-progress"])
    assert rc == 0
    assert "scale tuning: 2 steps" in capsys.readouterr().out


def test_cli_tuning_after_rtn_names_its_calibration_text(tiny_with_tokenizer, tmp_path, capsys):
    rc = main(["quantize", str(tiny_with_tokenizer), "--int4", "--num-calib-samples", "4", "--calib-seq-len", "32",
               "--tune-scales-steps", "1", "-o", str(tmp_path / "t"), "--no-progress"])
    assert rc == 0
    assert "; on 4 x 32 tokens of wikipedia:calib" in capsys.readouterr().out


def test_cli_refuses_tuning_an_activation_scheme(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["quantize", str(tiny_with_tokenizer), "--w8a8", "--tune-scales-steps", "2", "-o", str(out),
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "weight-only" in err
    assert not out.exists()
