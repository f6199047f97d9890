"""Streaming heads: the head scores, the choice by fraction, the per-head mask of the modeling
file against a dense reference, and the converted checkpoint's config."""
import json

import pytest
import torch

from attention_variants.convert import ConvertSpec, convert
from attention_variants.modeling.modeling_kvslim import per_head_mask
from attention_variants.streaming_heads import (
    auto_fraction,
    head_scores,
    head_scores_by_window,
    query_rows,
    streaming_kv_heads,
)
from foundation.attention_layout import AttentionLayout
from foundation.errors import KvslimError
from tests.attention_variants.helpers import logits
from tests.benchmark_scripts import load_benchmark

IDS = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
STREAMING = ((), (1,), (0, 1), (0,))  # per layer of the tiny model (2 KV heads): none, one, both, the other


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_scores_have_a_value_per_layer_and_kv_head(tiny_llama):
    scores = head_scores(_model(tiny_llama), IDS, window=8, sinks=2)
    assert set(scores) == {"mass", "output"}
    for s in scores.values():
        assert s.shape == (4, 2) and bool((s >= 0).all()) and float(s.sum()) > 0
    assert bool((scores["mass"] <= 1 + 1e-6).all())


def test_head_mass_averages_to_the_layer_mass_the_global_layers_rank_by(tiny_llama):
    """One pass over several windows gives each window's scores, and per layer the KV heads' mass
    averages to the layer's far mass (the rule ``--global-select calib`` ranks layers by, from the
    eager probabilities)."""
    from transformers import AutoModelForCausalLM

    from attention_variants.attention_inputs import capture_attention_inputs

    ids = torch.cat([IDS, IDS.flip(1)])
    both = head_scores_by_window(_model(tiny_llama), ids, (8, 16), sinks=2)
    eager = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32, attn_implementation="eager")
    layer_mass = {w: capture_attention_inputs(eager.eval(), ids, "ids", window=w).far_mass for w in (8, 16)}
    for w in (8, 16):
        one = head_scores(_model(tiny_llama), ids, window=w, sinks=2)
        for name in one:
            torch.testing.assert_close(both[w][name], one[name])
        torch.testing.assert_close(both[w]["mass"].mean(1), torch.tensor(layer_mass[w]), rtol=1e-4, atol=1e-6)


def test_a_window_that_sees_everything_loses_nothing(tiny_llama):
    """Window + sinks covering every position: streaming changes no output."""
    scores = head_scores(_model(tiny_llama), IDS, window=30, sinks=10)
    assert float(scores["output"].abs().max()) < 1e-10 and float(scores["mass"].max()) > 0  # mass counts sink keys


def test_long_sequences_are_scored_from_evenly_spaced_query_rows(tiny_llama, monkeypatch):
    """Past ``MAX_QUERY_ROWS`` a head's scores are means over evenly spaced rows ending at the last:
    near the all-rows scores, same layers ranked first."""
    import attention_variants.streaming_heads as sh

    assert query_rows(40).tolist() == list(range(40))
    full = head_scores(_model(tiny_llama), IDS, window=8, sinks=2)
    monkeypatch.setattr(sh, "MAX_QUERY_ROWS", 20)
    assert query_rows(40).tolist() == list(range(1, 40, 2)) and len(query_rows(41)) == 14
    sampled = head_scores(_model(tiny_llama), IDS, window=8, sinks=2)
    torch.testing.assert_close(sampled["mass"], full["mass"], atol=0.05, rtol=0)
    assert sampled["mass"].mean(1).argmax() == full["mass"].mean(1).argmax()


def test_scores_need_sequences_longer_than_the_window(tiny_llama):
    with pytest.raises(KvslimError, match="cannot score heads for window 40"):
        head_scores(_model(tiny_llama), IDS, window=40, sinks=2)


def test_the_lowest_scored_fraction_streams_across_layers():
    score = torch.tensor([[0.5, 0.1], [0.2, 0.9], [0.05, 0.3]])
    assert streaming_kv_heads(score, 0.5) == ((1,), (0,), (0,))
    assert streaming_kv_heads(score, 0.0) == ((), (), ())
    assert streaming_kv_heads(score, 1.0) == ((0, 1), (0, 1), (0, 1))
    assert streaming_kv_heads(score, 0.5, layers=[0, 2]) == ((1,), (), (0,))  # full layers only (Gemma 3)
    assert auto_fraction(9, 3) == 0.5 and auto_fraction(8, 8) == 0.75


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_per_head_mask_picks_each_heads_mask(dtype):
    full = torch.rand(2, 1, 5, 7) > 0.3 if dtype == torch.bool else torch.randn(2, 1, 5, 7)
    local = torch.rand(2, 1, 5, 7) > 0.6 if dtype == torch.bool else torch.randn(2, 1, 5, 7)
    mask = per_head_mask(full, local, [1], num_heads=6, num_kv_heads=3)  # query heads 2, 3 stream
    assert mask.shape == (2, 6, 5, 7)
    for h in range(6):
        assert torch.equal(mask[:, h], (local if h in (2, 3) else full)[:, 0])


def test_converted_checkpoint_equals_a_dense_per_head_reference(tiny_llama, tmp_path, monkeypatch):
    """The modeling file's per-head masks against the simulator's dense [H, T, T] masks, and both
    differ from the original."""
    import transformers.models.llama.modeling_llama as llama

    out = convert(tiny_llama, ConvertSpec(sliding_window=8, sinks=3, streaming_set=STREAMING), tmp_path / "sh").out
    config = json.loads((out / "config.json").read_text())
    assert config["streaming_heads"] == {"window": 8, "sinks": 3, "kv_heads": [list(h) for h in STREAMING]}
    assert "sliding_window" not in config and "auto_map" in config
    got, original = logits(out, IDS), logits(tiny_llama, IDS)
    sim = load_benchmark("streaming_heads_options")
    model = _model(tiny_llama)
    monkeypatch.setattr(llama.LlamaAttention, "forward", llama.LlamaAttention.forward)  # restored after
    streaming = torch.zeros(4, 2, dtype=torch.bool)
    for layer, heads in enumerate(STREAMING):
        streaming[layer, list(heads)] = True
    sim.install({"window": 8, "sinks": 3, "streaming": streaming})
    with torch.no_grad():
        want = model(IDS, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert not torch.allclose(got, original, atol=1e-3)


def test_layout_of_streaming_heads():
    config = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=384,
                  streaming_heads=dict(window=8, sinks=2, kv_heads=[[], [2, 0], [0, 1, 2]]))
    layout = AttentionLayout.from_config(config)
    kinds = [(e.kind, e.num_kv_heads, e.kv_source) for e in layout.entries]
    assert kinds == [("full", 3, 0), ("full", 1, 1), ("sliding", 3, 2), ("sliding", 2, 3)]
    assert [[p.heads for p in parts] for parts in layout.entry_parts] == [[(0, 1, 2)], [(1,), (0, 2)], [(0, 1, 2)]]
    assert layout.entry_layers == (0, 1, 2, 1)
    assert layout.config_updates()["streaming_heads"]["kv_heads"] == [[], [0, 2], [0, 1, 2]]
    head = 2 * 64 * 2  # K and V of one head, bf16
    assert layout.kv_bytes(100, 2) == head * (4 * 100 + 5 * 10)  # 4 full heads, 5 streaming (8 + 2 tokens)


@pytest.mark.parametrize("value, message", [
    ({"window": 8, "sinks": 2}, "must be"),
    ({"window": 0, "sinks": 2, "kv_heads": [[]] * 3}, "positive"),
    ({"window": 8, "sinks": 2, "kv_heads": [[]] * 2}, "one list of heads per layer"),
    ({"window": 8, "sinks": 2, "kv_heads": [[3], [], []]}, "distinct KV heads"),
    ({"window": 8, "sinks": 2, "kv_heads": [[1, 1], [], []]}, "distinct KV heads"),
])
def test_bad_streaming_config_is_one_line(value, message):
    config = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=384,
                  streaming_heads=value)
    with pytest.raises(KvslimError, match=message):
        AttentionLayout.from_config(config)


def test_streaming_heads_refuse_shared_or_sliding_layers():
    base = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=384)
    shared = dict(base, kv_source_layers=[0, 0, 2], streaming_heads=dict(window=8, sinks=2, kv_heads=[[1], [], []]))
    with pytest.raises(KvslimError, match="shares its KV"):
        AttentionLayout.from_config(shared)
