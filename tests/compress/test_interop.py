"""Our checkpoints load in transformers through compressed-tensors (CPU), bit-exactly.

Which load is compared: ``AutoModelForCausalLM.from_pretrained(out,
quantization_config=CompressedTensorsConfig(dequantize=True))`` -- transformers decompresses
every Linear with compressed-tensors' own compressor at load time and runs a dense model, so
no activation fake-quantization is applied (FP8_DYNAMIC's per-token activation quantization is
a runtime matter). Its logits are compared with the source model whose quantized Linears we
overwrite with ``dequantize_linear`` of the same on-disk tensors.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors import __version__ as ct_version

from compress.quantize import quantize_checkpoint
from compress.transformers_compat import default_route_fails
from foundation.checkpoint import Checkpoint
from foundation.primitives import dequantize_linear
from foundation.schemes import (
    FP8_DYNAMIC,
    FP8_W8A16,
    W4A16,
    W4A16_ASYM,
    W8A8,
    W8A16,
    default_scheme,
)

SCHEMES = {
    "fp8": FP8_DYNAMIC,
    "fp8_weight_only": FP8_W8A16,
    "w8a8": W8A8,
    "int8": W8A16,
    "int8_g32_asym": W8A16.with_options(group_size=32, symmetric=False),
    "int4_sym": W4A16.with_options(group_size=32),
    "int4_asym": W4A16_ASYM,
}
# What `compress quantize --KIND` writes with no other flag: each must load with the one line users know.
DEFAULT_KINDS = ("fp8", "fp8-weight-only", "w8a8", "int8", "int4")
SCHEMES.update({f"default_{kind}": default_scheme(kind) for kind in DEFAULT_KINDS})
# Fixed before measuring: the same dense weights through the same modeling code.
LOGITS_ATOL = 1e-5


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interop")
    return {k: quantize_checkpoint(tiny_llama, root / k, s, progress=False).out for k, s in SCHEMES.items()}


def load_decompressed(path: Path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()


def our_dequantized(path: Path, scheme) -> dict[str, torch.Tensor]:
    """module name -> our float weight, for every quantized Linear of the checkpoint."""
    ckpt = Checkpoint.open(path)
    modules = sorted({n.rsplit(".", 1)[0] for n in ckpt.names() if n.endswith(".weight_scale")})
    out = {}
    for m in modules:
        tensors = {n[len(m) + 1:]: ckpt.get(n) for n in ckpt.names() if n.rsplit(".", 1)[0] == m}
        out[m] = dequantize_linear(tensors, scheme)
    return out


def reference_model(source: Path, weights: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w)
    return model


def sample_ids(vocab: int = 512, n: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("key", sorted(SCHEMES))
def test_transformers_decompresses_exactly_our_weights(key, quantized, tiny_llama):
    scheme = SCHEMES[key]
    ours = our_dequantized(quantized[key], scheme)
    assert len(ours) == 4 * 7  # every projection of the 4 layers
    model = load_decompressed(quantized[key])
    for name, w in ours.items():
        theirs = model.get_submodule(name).weight.data
        assert theirs.dtype == w.dtype and torch.equal(theirs, w), name
    # Unquantized tensors are copied unchanged.
    src = Checkpoint.open(tiny_llama)
    assert torch.equal(model.model.embed_tokens.weight.data, src.get("model.embed_tokens.weight"))
    assert torch.equal(model.lm_head.weight.data, src.get("lm_head.weight"))

    ref = reference_model(tiny_llama, ours)
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("key", ["fp8", "fp8_weight_only", "w8a8", "int8", "int4_sym",
                                 *(f"default_{kind}" for kind in DEFAULT_KINDS)])
def test_default_transformers_load_runs_and_decompresses_on_first_forward(key, quantized):
    """The default route (no dequantize flag): compressed modules, decompressed on first forward.
    Every scheme ``compress quantize`` writes by default is here, so a default that plain
    ``from_pretrained`` cannot open fails this test."""
    assert not default_route_fails(SCHEMES[key])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(quantized[key], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(sample_ids()).logits
    assert torch.isfinite(logits).all()
    for name, w in our_dequantized(quantized[key], SCHEMES[key]).items():
        assert torch.equal(model.get_submodule(name).weight.data, w), name


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason=f"compressed-tensors {ct_version}'s load-time (meta) compress does not pack the zero "
                          "point, so transformers' default route expects [out, groups] where the format stores it "
                          "packed [out/8, groups] (as compressed-tensors' own compressor writes it); the flagged "
                          "--asymmetric scheme only; dequantize=True works (test above)")
def test_default_transformers_load_of_asymmetric_int4(quantized):
    from transformers import AutoModelForCausalLM

    assert default_route_fails(SCHEMES["int4_asym"])
    AutoModelForCausalLM.from_pretrained(quantized["int4_asym"], dtype=torch.float32)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma3_text"])
def test_other_architectures_round_trip(arch, tiny_checkpoints, tmp_path):
    scheme = W4A16.with_options(group_size=32, symmetric=False)
    out = quantize_checkpoint(tiny_checkpoints[arch], tmp_path / arch, scheme, progress=False).out
    ours = our_dequantized(out, scheme)
    model = load_decompressed(out)
    for name, w in ours.items():
        assert torch.equal(model.get_submodule(name).weight.data, w), name
    ref = reference_model(tiny_checkpoints[arch], ours)
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("key", ["fp8", "int4_sym"])
def test_bf16_output_dtype_round_trips(key, tiny_llama, tmp_path):
    """``dtype=bfloat16`` on an fp32 source: scales and unquantized tensors are stored in bf16 (the
    bf16 cast of the source's), config says bfloat16, and transformers decompresses exactly our
    weights; its logits equal a reference model holding those weights (same tolerance as above)."""
    out = quantize_checkpoint(tiny_llama, tmp_path / key, SCHEMES[key], progress=False, dtype=torch.bfloat16).out
    ckpt, src = Checkpoint.open(out), Checkpoint.open(tiny_llama)
    assert ckpt.config["dtype"] == "bfloat16"
    floats = [t for t in map(ckpt.get, ckpt.names()) if t.is_floating_point() and t.dtype != torch.float8_e4m3fn]
    assert floats and all(t.dtype == torch.bfloat16 for t in floats)  # scales, embeddings, norms, lm_head
    assert torch.equal(ckpt.get("model.embed_tokens.weight"), src.get("model.embed_tokens.weight").bfloat16())
    ours = our_dequantized(out, SCHEMES[key])
    model = load_decompressed(out)
    for name, w in ours.items():
        assert torch.equal(model.get_submodule(name).weight.data, w.float()), name
    ref = reference_model(tiny_llama, {n: w.float() for n, w in ours.items()})
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.removesuffix(".weight") not in ours:
                p.copy_(p.bfloat16().float())  # the source's unquantized tensors as stored: bf16
    ids = sample_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=LOGITS_ATOL)
