import json

import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.kv_report import (
    has_static_kv_scales,
    report_variant,
    share_pairs,
    variant_configs,
)

BASE = dict(num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3, hidden_size=96, head_dim=16)


def test_shared_layers_allocate_nothing():
    layout = AttentionLayout.from_config({**BASE, "kv_source_layers": share_pairs(["full_attention"] * 6)})
    spec = KVCacheSpec.from_layout(layout, "bf16", block_size=4)
    assert [g.layers for g in spec.groups] == [(0, 2, 4)]
    cache = KVCache(spec, (10,))
    assert cache.group_nbytes(0) == 3 * 2 * 10 * 4 * 3 * 16 * 2
    assert cache.layers[1].k_cache.data_ptr() == cache.layers[0].k_cache.data_ptr()
    assert cache.layers[3].k_cache.data_ptr() != cache.layers[0].k_cache.data_ptr()


def test_groups_split_by_window_and_dtype_scales():
    cfg = {**BASE, "sliding_window": 8, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(cfg), "int8", block_size=4)
    assert [(g.kind, g.window, len(g.layers)) for g in spec.groups] == [("sliding", 8, 5), ("full", None, 1)]
    assert spec.block_bytes(1) == 2 * 4 * 3 * (16 * 1 + 4)  # int8 values + fp32 per token/head scales
    assert spec.max_blocks_per_seq(0, 64) == 3 and spec.max_blocks_per_seq(1, 64) == 16


@pytest.mark.parametrize("name", list(variant_configs(BASE, window=16, full_every=3, short_window=8, sinks=4)))
def test_formula_equals_counted_and_capacity_fits_budget(name):
    cfg, kv_dtype = variant_configs(BASE, window=16, full_every=3, short_window=8, sinks=4)[name]
    budget, seq_len = 2 << 20, 64
    r = report_variant(name, cfg, kv_dtype, budget, seq_len, block_size=4)
    assert r.allocated_bytes <= budget
    assert r.counted_bytes_per_token == pytest.approx(r.formula_bytes_per_token)
    for g in r.groups:
        assert g.counted_bytes_per_token == pytest.approx(g.formula_bytes_per_token)
    # Every admitted sequence fits; one more would not. The planner reserves a decoding
    # sequence's worst case per sliding group (the window straddling one more block), and the
    # exact first block a low-bit sequence keeps (int2).
    assert r.capacity_seqs * seq_len * r.counted_bytes_per_token <= budget
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(cfg), kv_dtype, 4)
    reserved = sum(spec.max_blocks_per_seq(g, seq_len) * spec.block_bytes(g) + spec.exact_block_bytes(g)
                   for g in range(len(spec.groups)))
    assert (r.capacity_seqs + 1) * reserved > budget * 0.97


def test_variants_beat_original():
    reports = {n: report_variant(n, c, d, 4 << 20, 64, 4) for n, (c, d) in variant_configs(BASE, 16, 3, 8, 4).items()}
    base = reports["original bf16"].capacity_seqs
    assert all(r.capacity_seqs > base for n, r in reports.items() if n != "original bf16")
    assert reports["MQA (1 KV head)"].capacity_seqs >= 2.9 * base


def _with_kv_scales(src, out):
    """A copy of checkpoint ``src`` with per-layer ``k_scale``/``v_scale`` (as ``--kv-cache-fp8`` writes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    n = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    for i in range(n):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.02)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_static_checkpoint_scales_sized_as_the_engine_allocates(tiny_llama, tmp_path, kv_dtype):
    """With per-layer checkpoint scales the engine stores no per-token scales: the report's
    formula and counted bytes drop the 4 B per token, head, K and V, and match the engine's cache."""
    from runtime.engine.engine import Engine, EngineConfig

    path = _with_kv_scales(tiny_llama, tmp_path / "scaled")
    assert has_static_kv_scales(path) and not has_static_kv_scales(tiny_llama)
    config = json.loads((path / "config.json").read_text())
    layout = AttentionLayout.from_config(config)
    heads = sum(layout.layers[i].num_kv_heads for i in layout.cache_owners())
    budget, seq_len, bs = 2 << 20, 64, 4
    dynamic = report_variant("dynamic", config, kv_dtype, budget, seq_len, bs)
    static = report_variant("static", config, kv_dtype, budget, seq_len, bs, static_scales=True)
    assert (dynamic.kv_scales, static.kv_scales) == ("per token and head", "per layer")
    assert static.formula_bytes_per_token == pytest.approx(2 * heads * layout.head_dim)  # 1-byte values only
    assert static.counted_bytes_per_token == pytest.approx(static.formula_bytes_per_token)
    assert dynamic.formula_bytes_per_token - static.formula_bytes_per_token == pytest.approx(2 * heads * 4)
    assert static.capacity_seqs > dynamic.capacity_seqs
    # bf16 KV ignores the flag
    assert report_variant("bf16", config, "bf16", budget, seq_len, bs, static_scales=True).kv_scales == "none"

    engine = Engine.from_checkpoint(path, EngineConfig(kv_dtype=kv_dtype, block_size=bs, kv_cache_bytes=budget,
                                                       max_model_len=seq_len))
    assert engine.kv_spec.static_scales
    slot_bytes = engine.cache.group_nbytes(0) / (engine.cache.num_blocks[0] * bs)
    assert slot_bytes == pytest.approx(static.counted_bytes_per_token)  # one full-attention group


def test_fp8_calibrated_scales_are_not_reused_for_an_int8_cache(tiny_llama, tmp_path):
    """Scales calibrated as max/448 for an FP8 cache would clip an INT8 cache at 127/448 of the
    range: another quantized KV dtype chosen at serve time takes per-token scales instead."""
    from compress.decoder_stack import LazyDecoderStack
    from compress.kv_scales import KV_CACHE_SCHEME, KVScaleObserver
    from compress.layer_stream import LayerStream
    from compress.quantize import quantize_checkpoint
    from compress.sequential_quantizer import SequentialQuantizer
    from foundation.checkpoint import Checkpoint
    from foundation.schemes import FP8_W8A16
    from runtime.engine.engine import Engine, EngineConfig
    from tests.compress.calib_tokens import zipf_ids

    stream = LayerStream(LazyDecoderStack(Checkpoint.open(tiny_llama)), zipf_ids(2, 16, seed=3))
    quantizer = SequentialQuantizer(stream, "rtn", kv_observer=KVScaleObserver())
    out = quantize_checkpoint(tiny_llama, tmp_path / "kv", FP8_W8A16, quantizer=quantizer, progress=False,
                              kv_cache_scheme=KV_CACHE_SCHEME).out
    small = dict(kv_cache_bytes=2 << 20, max_model_len=64, block_size=4)
    served = Engine.from_checkpoint(out, EngineConfig(**small))
    assert served.kv_spec.groups[0].kv_dtype == "fp8_e4m3" and served.kv_spec.static_scales
    int8 = Engine.from_checkpoint(out, EngineConfig(kv_dtype="int8", **small))
    assert not int8.kv_spec.static_scales
