"""The streaming-heads simulator (benchmarks/streaming_heads_options.py) against the product: no
streaming head is the transformers model, and streaming every head of some layers is the
checkpoint ``compress convert --sliding-window W --sinks S`` writes for those layers."""
import torch

from attention_variants.convert import ConvertSpec
from tests.attention_variants.helpers import convert_tiny, logits
from tests.benchmark_scripts import load_benchmark


def test_simulation_matches_the_model_and_the_converted_checkpoint(tiny_llama, tmp_path, monkeypatch):
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    sim = load_benchmark("streaming_heads_options")
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    converted = convert_tiny(tiny_llama, tmp_path / "w8s3", ConvertSpec(sliding_window=8, global_layers=(3,), sinks=3))
    want_full, want_sinks = logits(tiny_llama, ids), logits(converted, ids)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32, attn_implementation="eager").eval()
    scores = sim.head_scores(model, ids, window=8, sinks=3)
    assert scores["far"].shape == (4, 2) and bool((scores["far"] <= scores["far_sinks"] + 1e-6).all())
    monkeypatch.setattr(llama.LlamaAttention, "forward", llama.LlamaAttention.forward)  # restored after
    state = {"window": 8, "sinks": 3, "streaming": torch.zeros(4, 2, dtype=torch.bool)}
    sim.install(state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, want_full, rtol=0, atol=1e-4)
        state["streaming"] = sim.streaming_by_layers((4, 2), [3])
        torch.testing.assert_close(model(ids, use_cache=False).logits, want_sinks, rtol=0, atol=1e-4)
    assert sim.streaming_by_score(scores["far"], 0.5).sum() == 4
    assert sim.kv_bytes_per_token(state["streaming"], 16, 40, 8, 3) < sim.kv_bytes_per_token(~state["streaming"], 16, 40, 8, 3)
