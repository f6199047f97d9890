"""Calibrated FP8 KV-cache scales: the observer sees exactly the keys/values transformers caches,
and the written scales load into compressed-tensors' attention parameters."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from compressed_tensors import __version__ as ct_version

from compress.decoder_stack import LazyDecoderStack
from compress.kv_scales import (
    FP8_E4M3_MAX,
    KV_CACHE_SCHEME,
    KVScaleObserver,
    kv_scale_tensors,
)
from compress.layer_stream import LayerStream
from compress.quantize import quantize_checkpoint
from compress.sequential_quantizer import SequentialQuantizer
from foundation.checkpoint import Checkpoint
from foundation.schemes import FP8_DYNAMIC
from tests.compress.calib_tokens import zipf_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_observer_sees_the_cached_keys_and_values(arch, tiny_checkpoints):
    from transformers import AutoModelForCausalLM, DynamicCache

    path = tiny_checkpoints[arch]
    ids = zipf_ids(2, 12, seed=7)  # within gemma3's 16-token window: its cache then keeps every key
    stream = LayerStream(LazyDecoderStack(Checkpoint.open(path)), ids, batch_tokens=1 << 20)
    observer = KVScaleObserver()
    for i in range(stream.stack.num_layers):
        stream.advance(i, {}, observer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        k_scale, v_scale = observer.scales(i)
        torch.testing.assert_close(k_scale, float(layer.keys.abs().max()) / FP8_E4M3_MAX, rtol=1e-6, atol=0)
        torch.testing.assert_close(v_scale, float(layer.values.abs().max()) / FP8_E4M3_MAX, rtol=1e-6, atol=0)
        per_head_k, _ = observer.per_head(i)
        assert per_head_k.shape == (model.config.num_key_value_heads,)


def test_scale_tensors_have_compressed_tensors_shape():
    obs = KVScaleObserver()
    obs.update(torch.full((1, 2, 3, 4), 4.48), torch.full((1, 2, 3, 4), -8.96), 0)
    t = kv_scale_tensors(obs, {0: "model.layers.0.self_attn"}, torch.bfloat16)
    assert t["model.layers.0.self_attn.k_scale"].shape == (1,)
    assert t["model.layers.0.self_attn.k_scale"].dtype == torch.bfloat16
    assert float(t["model.layers.0.self_attn.v_scale"]) == pytest.approx(0.02, rel=1e-2)


def test_kv_scales_load_into_compressed_tensors_attention(tiny_llama, tmp_path):
    """FP8 weights + FP8 KV: transformers (compressed, not decompressed) registers k_scale/v_scale
    on every attention module (compressed-tensors' initialize_attn_qparams) and loads ours."""
    from compressed_tensors.quantization.lifecycle.initialize import (
        is_cached_attention_module,  # private
    )
    from transformers import AutoModelForCausalLM

    stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), zipf_ids(2, 32, seed=8))
    quantizer = SequentialQuantizer(stream, "rtn", kv_observer=KVScaleObserver())
    out = quantize_checkpoint(tiny_llama, tmp_path / "kv", FP8_DYNAMIC, quantizer=quantizer,
                              progress=False, kv_cache_scheme=KV_CACHE_SCHEME).out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == KV_CACHE_SCHEME
    ckpt = Checkpoint.open(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if not is_cached_attention_module(model.model.layers[0].self_attn):
        pytest.xfail(f"compressed-tensors {ct_version} finds no cached attention in transformers "
                     f"{transformers.__version__} (it looks for a 'past_key_values' argument, renamed 'cache'), "
                     "so it registers no k_scale/v_scale; vLLM reads them from the file regardless")
    for i, layer in enumerate(model.model.layers):
        for kind in ("k_scale", "v_scale"):
            ours = ckpt.get(f"model.layers.{i}.self_attn.{kind}")
            assert ours.shape == (1,) and float(ours) > 0
            assert torch.equal(getattr(layer.self_attn, kind).data, ours)


def test_finish_refuses_when_a_layer_never_writes_its_cache(tiny_llama, monkeypatch):
    """A decoder layer that ignores the cache it is given (as transformers 5.24's layers ignored
    ``past_key_values``) leaves the observer empty: refused, not written as missing scales."""
    import compress.layer_stream as layer_stream
    from foundation.errors import KvslimError

    monkeypatch.setattr(layer_stream, "_cache_keyword", lambda layer, recorded: "not_a_cache_argument")
    stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), zipf_ids(2, 16, seed=3))
    quantizer = SequentialQuantizer(stream, "rtn", kv_observer=KVScaleObserver())
    with pytest.raises(KvslimError, match="saw no cache write from 4 of 4 layers"):
        quantizer.finish()


def test_every_layer_is_observed_through_the_real_cache_argument(tiny_checkpoints):
    for arch in ("llama", "gemma3_text"):
        stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_checkpoints[arch])), zipf_ids(2, 16, seed=3))
        quantizer = SequentialQuantizer(stream, "rtn", kv_observer=KVScaleObserver())
        scales = quantizer.finish()
        assert len(scales) == 2 * stream.stack.num_layers
        assert all(float(t) > 0 for t in scales.values())


def test_declared_kv_scheme_without_scales_is_refused_before_writing(tiny_llama, tmp_path):
    from foundation.errors import KvslimError

    with pytest.raises(KvslimError, match="kv_cache_scheme is declared but 8 of 8 KV-cache scales"):
        quantize_checkpoint(tiny_llama, tmp_path / "out", FP8_DYNAMIC, progress=False, kv_cache_scheme=KV_CACHE_SCHEME)
    assert list(tmp_path.iterdir()) == []


def test_inspect_flags_a_declared_kv_scheme_without_scales(tiny_llama, tmp_path, capsys):
    from cli.main import main

    stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), zipf_ids(2, 16, seed=3))
    quantizer = SequentialQuantizer(stream, "rtn", kv_observer=KVScaleObserver())
    out = quantize_checkpoint(tiny_llama, tmp_path / "kv", FP8_DYNAMIC, quantizer=quantizer, progress=False,
                              kv_cache_scheme=KV_CACHE_SCHEME).out
    assert main(["inspect", str(out)]) == 0
    capsys.readouterr()
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.2.self_attn.v_scale"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "missing tensor model.layers.2.self_attn.v_scale" in err
