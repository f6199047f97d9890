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


def test_a_smaller_block_reads_fewer_tokens_exact(tiny_llama, monkeypatch):
    """``"block": 16``: keys grouped and the open block read exact over 16 tokens, not 64."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    opts = load_benchmark("kv_quant_options")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        monkeypatch.setattr(llama.LlamaAttention, "forward", llama.LlamaAttention.forward)  # restored after
        opts.install([opts.Options({"bits": 2, "block": 16}, model.config.head_dim)])
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got[:, :16], want[:, :16], rtol=0, atol=1e-4)
    assert (got[:, 16:64] - want[:, 16:64]).abs().max() > 1e-3


def test_key_logprobs_are_the_answer_tokens_log_softmax(tiny_with_tokenizer):
    """benchmarks/kv_retrieval_logprob.py: each answer token's log-probability after the context,
    and whether all of them are the argmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = load_benchmark("kv_retrieval_logprob")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_with_tokenizer), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_with_tokenizer))
    got, hit = script.key_logprobs(model, tok, "The pass key is ", "12345")
    ids = tok("The pass key is ", return_tensors="pt")["input_ids"]
    key = tok("12345", add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    with torch.no_grad():
        logits = model(torch.cat([ids, key[None]], 1)).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(ids.shape[1] - 1, ids.shape[1] - 1 + len(key)), key]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert hit == bool((logits[ids.shape[1] - 1:-1].argmax(-1) == key).all())
