"""Per-token activation fake-quantizers, and calibration with them applied (FP8_DYNAMIC, W8A8), as served."""
from __future__ import annotations

import pytest
import torch

from compress.algorithms.gptq import GPTQOptions
from compress.decoder_stack import LazyDecoderStack
from compress.kv_scales import KV_CACHE_SCHEME, KVScaleObserver
from compress.layer_stream import SINK_WEIGHT, LayerStream
from compress.quantize import quantize_checkpoint
from compress.sequential_quantizer import SequentialQuantizer
from foundation.activation_quant import (
    activation_fake_quantizer,
    fake_quantize_fp8_per_token,
    fake_quantize_int8_per_token,
)
from foundation.checkpoint import Checkpoint
from foundation.schemes import FP8_DYNAMIC, W8A8, W8A16, ActivationQuant
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
