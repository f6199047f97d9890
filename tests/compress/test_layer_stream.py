"""The layer-by-layer stream reproduces transformers' forward, and streaming GPTQ (+ KV scales)
writes byte-identical shards to the in-memory path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from compress.algorithms.gptq import GPTQOptions
from compress.decoder_stack import (
    LazyDecoderStack,
    ResidentDecoderStack,
    layer_of_module,
)
from compress.kv_scales import KV_CACHE_SCHEME, KVScaleObserver
from compress.layer_stream import LayerStream
from compress.quantize import DEFAULT_IGNORE, plan_linears, quantize_checkpoint
from compress.sequential_quantizer import SequentialQuantizer
from foundation.checkpoint import Checkpoint
from foundation.schemes import W4A16_ASYM
from tests.compress.calib_tokens import zipf_ids


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_stream_matches_transformers_forward(arch, tiny_checkpoints):
    """Running the layers one at a time (lazily loaded) gives the model's own final hidden states."""
    path = tiny_checkpoints[arch]
    ids = zipf_ids(3, 40, seed=0)  # longer than gemma3's 16-token window
    stream = LayerStream(LazyDecoderStack(Checkpoint.open(path)), ids, batch_tokens=80)
    assert len(stream.batches) == 2  # batches of 2 then 1 sample
    for i in range(stream.stack.num_layers):
        stream.advance(i, {})
    ours = torch.cat(stream.final_hidden())
    with torch.no_grad():
        ref = load_hf(path).base_model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_layer_of_module():
    assert layer_of_module("model.layers.12.mlp.up_proj") == 12
    assert layer_of_module("lm_head") is None


def in_memory_quantize(path: Path, ids: torch.Tensor, out: Path, method: str, scheme=W4A16_ASYM,
                       options: GPTQOptions = GPTQOptions(), activations=None) -> None:
    """The reference path: the whole model in memory (transformers), quantized in place layer by
    layer with the same algorithm, all tensors saved in one go."""
    ckpt = Checkpoint.open(path)
    model = load_hf(path)
    stream = LayerStream(ResidentDecoderStack(model), ids, activations=activations)
    quantizer = SequentialQuantizer(stream, method, options, KVScaleObserver())
    targets = plan_linears(ckpt, scheme, DEFAULT_IGNORE)
    state = {n: t.detach().clone() for n, t in model.state_dict().items() if ckpt.has(n)}
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(targets, key=lambda n: layer_of_module(n) if layer_of_module(n) is not None else 1 << 30):
        module = name.removesuffix(".weight")
        for key, t in quantizer.quantize(module, state.pop(name), scheme).items():
            tensors[f"{module}.{key}"] = t
    tensors.update(state)
    tensors.update(quantizer.finish())
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("arch,method", [("llama", "gptq"), ("gemma3_text", "rtn")])
def test_streaming_is_byte_identical_to_in_memory(arch, method, tiny_checkpoints, tmp_path):
    path = tiny_checkpoints[arch]
    ids = zipf_ids(4, 48, seed=1)
    stream = LayerStream(LazyDecoderStack(Checkpoint.open(path)), ids)
    quantizer = SequentialQuantizer(stream, method, GPTQOptions(), KVScaleObserver())
    streamed = quantize_checkpoint(path, tmp_path / "streamed", W4A16_ASYM, quantizer=quantizer,
                                   progress=False, kv_cache_scheme=KV_CACHE_SCHEME).out
    in_memory_quantize(path, ids, tmp_path / "memory", method)
    a = (streamed / "model.safetensors").read_bytes()
    b = (tmp_path / "memory" / "model.safetensors").read_bytes()
    assert a == b
    names = Checkpoint.open(streamed).names()
    assert sum(n.endswith("self_attn.k_scale") for n in names) == 4
