"""Per-token activation fake-quantizers, and calibration with them applied (FP8_DYNAMIC, W8A8), as served."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from compress.activation_quant import activation_fake_quantizer, fake_quantize_fp8_per_token, fake_quantize_int8_per_token
from compress.algorithms.gptq import GPTQOptions
from compress.checkpoint import Checkpoint
from compress.kv_scales import KV_CACHE_SCHEME, KVScaleObserver
from compress.layer_stream import SINK_WEIGHT, LayerStream, LazyDecoderStack, SequentialQuantizer
from compress.quantize import quantize_checkpoint
from compress.schemes import FP8_DYNAMIC, W8A8, W8A16, ActivationQuant
from tests.compress.calib_tokens import zipf_ids
from tests.compress.test_layer_stream import in_memory_quantize


def test_fake_quantizer_per_scheme():
    assert activation_fake_quantizer(None) is None
    assert activation_fake_quantizer(W8A16.input_activations) is None
    assert activation_fake_quantizer(FP8_DYNAMIC.input_activations) is fake_quantize_fp8_per_token
    assert activation_fake_quantizer(W8A8.input_activations) is fake_quantize_int8_per_token
    with pytest.raises(ValueError, match="static per-tensor"):
        activation_fake_quantizer(ActivationQuant(8, "float", "tensor", dynamic=False))


def test_served_activations_keep_shared_hessians(tiny_llama):
    """With FP8 inputs applied, q/k/v still share one Hessian, built from the quantized input."""
    ids = zipf_ids(2, 16, seed=3)
    plain = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), ids)
    served = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), ids,
                         activations=activation_fake_quantizer(FP8_DYNAMIC.input_activations))
    h_plain, _ = plain.hessians(0)
    h_served, alias = served.hessians(0)
    p = "model.layers.0."
    assert alias[p + "self_attn.k_proj"] == alias[p + "self_attn.q_proj"] == alias[p + "self_attn.v_proj"]
    assert len(h_served) == 4
    layer = served.stack.load_layer(0, {})
    x = fake_quantize_fp8_per_token(layer.input_layernorm(served.batches[0].hidden))
    x[:, 0] *= SINK_WEIGHT**0.5
    n = x.shape[0] * x.shape[1]
    expected = 2.0 / n * x.reshape(n, -1).t() @ x.reshape(n, -1)
    owner = alias[p + "self_attn.q_proj"]
    torch.testing.assert_close(h_served[owner], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(h_served[owner], h_plain[owner])


def test_served_stream_runs_layers_as_served(tiny_llama):
    """After a layer, the stream holds what the layer gives with every Linear's input quantized."""
    ids = zipf_ids(2, 16, seed=4)
    acts = activation_fake_quantizer(W8A8.input_activations)
    stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), ids, activations=acts)
    inputs = stream.batches[0].hidden
    stream.advance(0, {})
    layer = stream.stack.load_layer(0, {})
    handles = [m.register_forward_pre_hook(lambda mod, a: (acts(a[0]), *a[1:]))
               for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    args, kwargs = stream.batches[0].layer_args[0]
    with torch.no_grad():
        expected = layer(inputs, *args, **kwargs)
    for h in handles:
        h.remove()
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.equal(stream.batches[0].hidden, expected)


def test_served_streaming_is_byte_identical_to_in_memory(tiny_llama, tmp_path):
    """Streamed and resident paths apply the activation quantization alike: same bytes; and it
    changes the result."""
    ids = zipf_ids(4, 48, seed=1)
    acts = activation_fake_quantizer(FP8_DYNAMIC.input_activations)

    def streamed(name: str, activations):
        stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), ids, activations=activations)
        out = quantize_checkpoint(tiny_llama, tmp_path / name, FP8_DYNAMIC, progress=False,
                                  quantizer=SequentialQuantizer(stream, "gptq", GPTQOptions(), KVScaleObserver()),
                                  kv_cache_scheme=KV_CACHE_SCHEME).out
        return (out / "model.safetensors").read_bytes()

    in_memory_quantize(tiny_llama, ids, tmp_path / "memory", "gptq", FP8_DYNAMIC, GPTQOptions(), acts)
    served = streamed("served", acts)
    assert served == (tmp_path / "memory" / "model.safetensors").read_bytes()
    assert served != streamed("plain", None)


def test_the_sensitivity_benchmarks_mantissa_only_fp8_equals_fp8_in_the_normal_range(monkeypatch):
    """benchmarks/fp8_activation_sensitivity.py's no-exponent-floor emulation is E4M3 wherever E4M3
    has no subnormals (scaled magnitudes >= 2^-6), and differs only below that."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("fp8_activation_sensitivity", bench / "fp8_activation_sensitivity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop("dev_slice", None)
    g = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    normal = sign * torch.exp2(torch.empty(4, 64).uniform_(-5, 8, generator=g))  # 448 / amax keeps them >= 2^-6
    normal[:, 0] = 448.0
    assert torch.equal(module.mantissa_only_per_token(normal), fake_quantize_fp8_per_token(normal))
    tiny = normal.clone()
    tiny[:, 1] = 2.0**-9 * 1.3  # subnormal in E4M3: rounded on a coarser absolute grid
    assert not torch.equal(module.mantissa_only_per_token(tiny), fake_quantize_fp8_per_token(tiny))
