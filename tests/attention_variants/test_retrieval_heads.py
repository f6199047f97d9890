"""Retrieval heads: the fact mass a KV head's query heads put from the prompt's end is the model's own
attention probability there (eager attention as the reference), Qwen3's per-head norms included."""
import pytest
import torch

import attention_variants.retrieval_heads as retrieval_heads


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_fact_mass_is_the_models_last_rows_attention(tiny_checkpoints, arch):
    """Each of the last QUERY_ROWS rows sees only the keys before it, as the model does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    fact = torch.zeros(24, dtype=torch.bool)
    fact[5:9] = True
    probe = retrieval_heads.RetrievalHeadProbe(model)
    probe.fact, probe.prompts = fact, 1
    try:
        attentions = model(input_ids=ids, output_attentions=True).attentions  # per layer [1, H, T, T]
    finally:
        scores = probe.remove()
    kvh = model.config.num_key_value_heads
    rows = retrieval_heads.QUERY_ROWS
    expected = torch.stack([a[0, :, -rows:, fact].sum(-1).mean(-1).view(kvh, -1).mean(-1) for a in attentions])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
