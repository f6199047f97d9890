import inspect
from dataclasses import replace

import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.sliding import global_layers_every
from attention_variants.summary import load_for_eval
from foundation.attention_layout import FULL, SLIDING
from tests.attention_variants.helpers import config_of, convert_tiny, logits

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_window_larger_than_sequence_changes_nothing(tiny_checkpoints, tmp_path, arch):
    src = tiny_checkpoints[arch]
    out = convert_tiny(src, tmp_path / "w64", ConvertSpec(sliding_window=64, global_every=2))
    config = config_of(out)
    assert config["layer_types"] == [SLIDING, FULL, SLIDING, FULL] and config["sliding_window"] == 64
    assert ("auto_map" in config) == (arch == "llama")  # Qwen2 honours layer_types natively
    torch.testing.assert_close(logits(out, IDS), logits(src, IDS), atol=1e-5, rtol=1e-5)


def test_window_shorter_than_sequence_changes_only_late_tokens(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "w8", ConvertSpec(sliding_window=8, global_layers=(3,)))
    assert config_of(out)["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL]
    new, ref = logits(out, IDS), logits(tiny_llama, IDS)
    torch.testing.assert_close(new[:, :8], ref[:, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(new[:, 8:], ref[:, 8:], atol=1e-3)


def test_calibrated_global_layers(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "cal", ConvertSpec(sliding_window=16, global_every=2, global_select="calib"),
                       calibrate=True)
    assert config_of(out)["layer_types"].count(FULL) == 2


def test_one_global_layer_in_g():
    assert global_layers_every(30, 6) == [5, 11, 17, 23, 29]


def test_sinks_keep_the_first_tokens_visible(tiny_llama, tmp_path):
    """Sinks change nothing before the window is full, and every later token; the modeling file's
    cached decode (its DynamicCache keeps every token of the sink layers) equals one pass."""
    spec = ConvertSpec(sliding_window=8, global_layers=(3,))
    plain = convert_tiny(tiny_llama, tmp_path / "w8", spec)
    sinks = convert_tiny(tiny_llama, tmp_path / "w8s2", replace(spec, sinks=2))
    config = config_of(sinks)
    assert config["num_sink_tokens"] == 2 and "auto_map" in config
    new, ref = logits(sinks, IDS), logits(plain, IDS)
    torch.testing.assert_close(new[:, :8], ref[:, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(new[:, 8:], ref[:, 8:], atol=1e-3)
    assert_cached_decode_equals_one_pass(sinks, new)


def test_gemma_sinks_in_the_modeling_file(tiny_checkpoints, tmp_path):
    """Gemma 3's own sliding layers gain sinks through our class; cached decode equals one pass."""
    src = tiny_checkpoints["gemma3_text"]
    out = convert_tiny(src, tmp_path / "gemma_s2", ConvertSpec(sinks=2))
    assert config_of(out)["auto_map"]["AutoModelForCausalLM"].endswith("KvslimGemma3ForCausalLM")
    new = logits(out, IDS)
    assert not torch.allclose(new, logits(src, IDS), atol=1e-3)
    assert_cached_decode_equals_one_pass(out, new)


def assert_cached_decode_equals_one_pass(checkpoint, one_pass: torch.Tensor, prefill: int = 12) -> None:
    model = load_for_eval(checkpoint)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=IDS[:, :prefill], use_cache=True)
        steps, cache = [out.logits], getattr(out, cache_arg)
        for t in range(prefill, IDS.shape[1]):
            out = model(input_ids=IDS[:, t:t + 1], use_cache=True, **{cache_arg: cache})
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), one_pass, atol=1e-4, rtol=1e-4)



def test_far_mass_is_what_the_returned_probabilities_give(tiny_llama):
    """The hooks measure, per window, what transformers' own returned probabilities give."""
    from transformers import AutoModelForCausalLM

    from attention_variants.attention_inputs import _far_mass, capture_attention_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mass = {w: capture_attention_inputs(model, ids, "random ids", window=w).far_mass for w in (8, 16)}
    with torch.no_grad():
        attns = [model(input_ids=row[None], output_attentions=True).attentions for row in ids]
    for w in (8, 16):
        expected = [sum(_far_mass(a[layer], w) for a in attns) / 2 for layer in range(4)]
        assert list(mass[w]) == pytest.approx(expected, rel=1e-5)
    assert all(a > b for a, b in zip(mass[8], mass[16]))  # more of the attention lies beyond a shorter window
