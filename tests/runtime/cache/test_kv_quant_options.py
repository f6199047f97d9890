"""The KV-options simulator (benchmarks/kv_quant_options.py): exact when nothing is quantized, and
a token reads its own block exact."""
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("kv_quant_options", ROOT / "benchmarks" / "kv_quant_options.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simulated_attention_matches_transformers_and_keeps_the_first_block_exact(tiny_llama, monkeypatch):
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoModelForCausalLM

    opts = _script()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(3, 500, (1, 3 * opts.BLOCK), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        monkeypatch.setattr(llama.LlamaAttention, "forward", llama.LlamaAttention.forward)  # restored after
        current = [opts.Options({"bits": 0}, model.config.head_dim)]
        opts.install(current)
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=0, atol=1e-4)
        for spec in ({"bits": 4}, {"bits": 2, "pre_rope": True, "v_rot": True, "clip": True},
                     {"bits": 2, "sym": True, "exact_first": True}):
            current[0] = opts.Options(spec, model.config.head_dim)
            got = model(ids, use_cache=False).logits
            first = opts.BLOCK
            torch.testing.assert_close(got[:, :first], want[:, :first], rtol=0, atol=1e-4)
            assert (got[:, first:] - want[:, first:]).abs().max() > 1e-3
