"""The quantize plan: every check once, calibration text tokenized once for every pass."""
from __future__ import annotations

from pathlib import Path

import pytest

import compress.quantize as quantize
import compress.quantize_plan as quantize_plan
import foundation.atomic as atomic
import foundation.calibration as calibration
from cli.main import main
from compress.quantize_options import QuantizeOptions
from compress.quantize_plan import plan_quantization, run_plan
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError


@pytest.fixture
def counted(monkeypatch) -> dict[str, list]:
    """Calls of the work that must run once: tokenizing calibration text, checking the output
    directory, opening and checking the source, planning the Linears."""
    calls: dict[str, list] = {"tokenize": [], "check_output_dir": [], "open": [], "check_source": [], "plan": []}

    real_tokenizer = calibration.load_tokenizer

    def load_tokenizer(model_dir):
        tokenizer = real_tokenizer(model_dir)

        def tokenize(text, **kwargs):
            calls["tokenize"].append(len(text))
            return tokenizer(text, **kwargs)

        return tokenize

    monkeypatch.setattr(calibration, "load_tokenizer", load_tokenizer)

    real_check = atomic.check_output_dir

    def check_output_dir(out, force):
        calls["check_output_dir"].append(Path(out))
        return real_check(out, force)

    for module in (atomic, quantize, quantize_plan):
        monkeypatch.setattr(module, "check_output_dir", check_output_dir)

    real_open = Checkpoint.open.__func__
    monkeypatch.setattr(Checkpoint, "open",
                        classmethod(lambda cls, path: calls["open"].append(Path(path)) or real_open(cls, path)))
    real_check_source = quantize.check_checkpoint
    monkeypatch.setattr(quantize, "check_checkpoint",
                        lambda *a, **kw: calls["check_source"].append(a[0].path) or real_check_source(*a, **kw))
    real_plan = quantize.plan_linears
    counting_plan = lambda *a, **kw: calls["plan"].append(a[0].path) or real_plan(*a, **kw)  # noqa: E731
    monkeypatch.setattr(quantize, "plan_linears", counting_plan)
    monkeypatch.setattr(quantize_plan, "plan_linears", counting_plan)
    return calls


def _calls_once(calls: dict[str, list], source: Path, out: Path) -> None:
    assert len(calls["tokenize"]) == 1, calls["tokenize"]
    assert calls["check_output_dir"] == [out.resolve()]
    assert [p for p in calls["open"] if p.resolve() == source.resolve()] == [source]
    assert calls["check_source"] == [source] and calls["plan"] == [source]


def test_smooth_gptq_and_kv_scales_tokenize_once_and_check_once(tiny_with_tokenizer, tmp_path, counted, capsys):
    out = tmp_path / "q"
    rc = main(["quantize", str(tiny_with_tokenizer), "--w8a8", "--smooth", "--method", "gptq", "--kv-cache-fp8",
               "--num-calib-samples", "2", "--calib-seq-len", "32", "-o", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "smoothing: SmoothQuant (alpha 0.8)" in stdout and "calibration (GPTQ + FP8 KV-cache scales)" in stdout
    assert Checkpoint.open(out).has("model.layers.0.self_attn.k_scale")
    _calls_once(counted, tiny_with_tokenizer, out)


def test_gptq_and_scale_tuning_share_the_windows(tiny_with_tokenizer, tmp_path, counted):
    out = tmp_path / "t"
    options = QuantizeOptions(model=str(tiny_with_tokenizer), output=str(out), kind="int4", method="gptq",
                              num_calib_samples=4, calib_seq_len=32, tune_scales_steps=1, progress=False)
    plan = plan_quantization(options)
    assert plan.calib_ids.shape == (4, 32) and plan.scheme.actorder == "weight"
    assert not out.exists()
    done = run_plan(plan)
    assert done.tuning.startswith("scale tuning: 1 steps") and done.tuning.endswith("on 4 x 32 tokens of wikipedia:calib")
    assert done.smoothing == "" and done.calibration.startswith("calibration (GPTQ): 4 x 32 tokens")
    assert done.result.out == out.resolve()
    _calls_once(counted, tiny_with_tokenizer, out)


def test_rtn_reads_no_calibration_text(tiny_with_tokenizer, tmp_path, counted):
    plan = plan_quantization(QuantizeOptions(model=str(tiny_with_tokenizer), output=str(tmp_path / "r"), kind="int8"))
    assert plan.calibration is None and plan.calib_ids is None and plan.describe_calibration() == ""
    assert counted["tokenize"] == []


def test_refusals_come_before_any_pass(tiny_with_tokenizer, tmp_path, counted):
    """A refused combination is refused by the plan: no calibration text read, no output."""
    options = QuantizeOptions(model=str(tiny_with_tokenizer), output=str(tmp_path / "o"), kind="w8a8", smooth=0.5,
                              act_order=True)
    with pytest.raises(KvslimError, match="GPTQ option"):
        plan_quantization(options)
    assert counted["tokenize"] == [] and not (tmp_path / "o").exists()


def test_too_short_text_names_the_window_flags(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Only a few words.")
    options = QuantizeOptions(model=str(tiny_with_tokenizer), output=str(tmp_path / "o"), kind="fp8",
                              kv_cache_fp8=True, calib=str(text), num_calib_samples=2, calib_seq_len=32)
    with pytest.raises(KvslimError, match=r"need 64 \(lower --num-calib-samples or --calib-seq-len\)"):
        plan_quantization(options)
