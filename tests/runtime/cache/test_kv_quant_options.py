"""The KV-options simulator (benchmarks/kv_quant_options.py): exact when nothing is quantized, and
a token reads its own block exact."""
import torch

from tests.benchmark_scripts import load_benchmark


def test_simulated_attention_matches_transformers_and_keeps_the_first_block_exact(tiny_llama, monkeypatch):
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    opts = load_benchmark("kv_quant_options")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 3 * opts.BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        monkeypatch.setattr(llama.LlamaAttention, "forward", llama.LlamaAttention.forward)  # restored after
        current = [opts.Options({"bits": 0}, model.config.head_dim)]
        opts.install(current)
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=0, atol=1e-4)
        for spec in ({"bits": 4}, {"bits": 2, "pre_rope": True, "v_rot": True, "clip": True},
                     {"bits": 2, "sym": True, "exact_first": True},
                     {"bits": 2, "levels": "normal", "k_clip": 0.25, "v_outliers": 0.05}):
            current[0] = opts.Options(spec, model.config.head_dim)
            got = model(ids, use_cache=False).logits
            first = opts.BLOCK
            torch.testing.assert_close(got[:, :first], want[:, :first], rtol=0, atol=1e-4)
            assert (got[:, first:] - want[:, first:]).abs().max() > 1e-3
