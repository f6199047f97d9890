"""SmoothQuant (`compress quantize --smooth`): the smoothed model computes the same function, its
activations lose their outlier channels, and the CLI refuses what smoothing cannot serve."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cli.main import main
from compress.quantize import quantize_checkpoint
from compress.smoothing import (
    input_maxima,
    smooth_checkpoint,
    smoothed,
    smoothing_sites,
)
from compress.smoothing_spec import SmoothingSpec
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.schemes import default_scheme
from tests.compress.calib_tokens import zipf_ids
from tests.compress.test_gptq_cli import bad
from tests.runtime.hf_oracle import hf_logits, hf_model, runtime_logits
from tests.tiny_models import make_tiny_checkpoint

CALIB = zipf_ids(4, 64, seed=0)
# fp32 rounding of the rescaled weights and norms, against logits of magnitude ~4 (fixed before measuring)
EXACT_ATOL = 1e-4

VARIANTS = {
    "llama_gqa": ("llama", {}),
    "qwen2_bias": ("qwen2", dict(attention_bias=True)),
    "llama_mlp_bias_mqa": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    "qwen3": ("qwen3", {}),
    "gemma3_offset_norm": ("gemma3_text", {}),
}


def _materialise(ckpt: Checkpoint, out: Path) -> Path:
    """Write every tensor as ``ckpt`` reads it (smoothed), with the source's config."""
    out.mkdir()
    save_file({n: ckpt.get(n).contiguous() for n in ckpt.names()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(ckpt.config))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_smoothing_keeps_the_function(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    src = make_tiny_checkpoint(tmp_path / "src", arch, **overrides)
    original = Checkpoint.open(src)
    smooth, report = smooth_checkpoint(original, CALIB, SmoothingSpec(0.8))
    assert report.sites == 4 * 4 and report.layers == 4
    assert max((smooth.get(n) - original.get(n)).abs().max().item() for n in original.names()) > 0.1
    ids = zipf_ids(1, 40, seed=7)[0]
    ref = hf_logits(hf_model(src), ids)
    got = hf_logits(hf_model(_materialise(smooth, tmp_path / "smoothed")), ids)
    assert (got - ref).abs().max().item() <= EXACT_ATOL


def test_smoothing_flattens_the_channels_a_norm_feeds(tiny_checkpoints, tmp_path):
    """Per-token quantization's range is set by the largest channel: after smoothing at alpha 1 the
    inputs of q/k/v and gate/up have every channel's maximum equal (s = amax(X))."""
    original = Checkpoint.open(tiny_checkpoints["llama"])
    before = input_maxima(original, CALIB)
    smooth, _ = smoothed(original, before, SmoothingSpec(1.0))
    after = input_maxima(smooth, CALIB)
    for module in ("model.layers.2.self_attn.q_proj", "model.layers.2.mlp.gate_proj"):
        spread = lambda m: (m.max() / m.min()).item()  # noqa: E731
        assert spread(before[module]) > 2.0
        assert spread(after[module]) == pytest.approx(1.0, abs=1e-3)


def test_kv_sharing_skips_v_to_o(tiny_checkpoints):
    """Where layers read another layer's V, scaling v_proj's rows would change what they read."""
    ckpt = Checkpoint.open(tiny_checkpoints["llama"])
    assert sum(s.linears[0].endswith("o_proj") for s in smoothing_sites(ckpt)) == 4
    shared = dataclasses.replace(ckpt, config={**ckpt.config, "kv_source_layers": [0, 0, 2, 2]})
    sites = smoothing_sites(shared)
    assert len(sites) == 3 * 4 and not any(s.linears[0].endswith("o_proj") for s in sites)


@pytest.mark.parametrize("kind", ["w8a8", "fp8"])
def test_runtime_matches_transformers_on_a_smoothed_checkpoint(tiny_checkpoints, tmp_path, kind):
    """A smoothed checkpoint is an ordinary compressed-tensors one: the runtime's logits equal
    transformers + compressed-tensors' (activations quantized per token by both)."""
    from runtime.model.loader import load_model
    from tests.runtime.model.layers.test_linear import _w8a8_logits_close

    smooth, _ = smooth_checkpoint(Checkpoint.open(tiny_checkpoints["llama"]), CALIB, SmoothingSpec(0.8))
    out = quantize_checkpoint(smooth, tmp_path / kind, default_scheme(kind), progress=False).out
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(hf_model(out), ids)
    got = runtime_logits(load_model(out, "float32"), ids, (10,))
    if kind == "w8a8":
        _w8a8_logits_close(got, ref)  # INT8 rounding ties: see tests/runtime/model/layers/test_linear.py
    else:
        assert (got - ref).abs().max().item() <= 1e-4


def test_cli_smooth_end_to_end(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(["quantize", str(tiny_with_tokenizer), "--w8a8", "--smooth", "--num-calib-samples", "2",
               "--calib-seq-len", "64", "-o", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "SmoothQuant (alpha 0.8): 16 sites in 4 layers, on 2 x 64 tokens of wikipedia:calib" in stdout
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(Checkpoint.open(out).get(norm), Checkpoint.open(tiny_with_tokenizer).get(norm))


def test_cli_smooth_with_gptq_and_kv_scales(tiny_with_tokenizer, tmp_path):
    rc = main(["quantize", str(tiny_with_tokenizer), "--fp8", "--smooth", "0.5", "--method", "gptq",
               "--kv-cache-fp8", "--num-calib-samples", "2", "--calib-seq-len", "64", "-o", str(tmp_path / "g"),
               "--no-progress"])
    assert rc == 0


@pytest.mark.parametrize("args, message", [
    (["--w8a8", "--smooth", "0"], "(0, 1]"),
    (["--w8a8", "--smooth", "1.5"], "(0, 1]"),
    (["--w8a8", "--smooth", "nan"], "(0, 1]"),
    (["--int4", "--smooth"], "keeps activations unquantized"),
    (["--fp8-weight-only", "--smooth", "0.5"], "keeps activations unquantized"),
    (["--w8a8", "--smooth", "--act-order"], "GPTQ option"),  # refused before the statistics pass
    (["--w8a8", "--smooth", "--ignore", "nosuch"], "matches no Linear"),
])
def test_cli_bad_smoothing_is_one_line(tiny_with_tokenizer, tmp_path, capsys, args, message):
    assert message in bad([str(tiny_with_tokenizer), *args], tmp_path / "o", capsys)


def test_spec_is_checked():
    with pytest.raises(KvslimError, match="migration strength"):
        SmoothingSpec(-0.1).check()


@pytest.mark.parametrize("flags", [["--smooth"], ["--method", "gptq"]])
def test_calibrating_a_kv_shared_checkpoint_is_one_line(tiny_with_tokenizer, tmp_path, capsys, flags):
    """transformers' own layers cannot run cross-layer KV sharing: calibration says so (it said
    'missing tensor ...k_proj.weight' of a checkpoint that is whole)."""
    from attention_variants.convert import ConvertSpec, convert

    shared = convert(tiny_with_tokenizer, ConvertSpec(kv_share=2, merge="mean"), tmp_path / "shared").out
    err = bad([str(shared), "--w8a8", *flags, "--num-calib-samples", "2", "--calib-seq-len", "32"],
              tmp_path / "o", capsys)
    assert "shares KV across layers" in err
