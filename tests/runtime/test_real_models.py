"""The runtime on the real models: SmolLM2-135M (the default) and Gemma-3-270M, fp32, against
transformers on real text; and the default model quantized to INT4.

Tolerances (fixed up front): max |logit diff| <= 1e-3 on logits of magnitude ~40 (fp32,
summation order only); greedy tokens equal transformers' up to the first near-tie (< 1e-3).
"""
from __future__ import annotations

import pytest
import torch

from compress.quantize import quantize_checkpoint
from foundation.checkpoint import Checkpoint
from foundation.model_source import resolve_model
from foundation.schemes import default_scheme
from foundation.texts import load_text
from runtime.engine.sampling import SamplingParams
from runtime.llm import LLM
from runtime.model.loader import live_weight_bytes, load_model
from tests.runtime.hf_oracle import (  # noqa: F401
    assert_greedy_matches_hf,
    hf_logits,
    hf_model,
    runtime_logits,
    single_thread,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

TEXT = "pydoc:eval"


def _real_ids(tokenizer, n: int) -> torch.Tensor:
    return torch.tensor(tokenizer(load_text(TEXT)[:20000])["input_ids"][:n])


@pytest.mark.parametrize("name,n,splits", [
    ("smollm2", 256, (200, 240)),
    ("gemma3-270m", 560, (520, 540)),  # past the 512-token window: sliding layers drop keys
])
def test_logits_and_greedy_match_transformers(name, n, splits):
    path = resolve_model(name)
    llm = LLM(path)
    ids = _real_ids(llm.tokenizer, n)
    assert len(ids) == n
    hf = hf_model(path)
    ref = hf_logits(hf, ids)
    got = runtime_logits(llm.model, ids, splits)
    assert (got - ref).abs().max().item() <= 1e-3
    prompt = "def fibonacci(n):" if name == "smollm2" else "The capital of France is"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    agreed = assert_greedy_matches_hf(hf, list(out.prompt_token_ids), list(out.outputs[0].token_ids))
    assert agreed >= 1


def test_default_model_int4_stays_packed_and_close(default_model_dir, tmp_path):
    out = quantize_checkpoint(default_model_dir, tmp_path / "int4", default_scheme("int4"), progress=False).out
    ckpt = Checkpoint.open(out)
    expected = 0
    for n, t in ckpt.iter_tensors():
        packed = n.rsplit(".", 1)[-1].startswith("weight_")
        expected += t.numel() * (t.element_size() if packed else 2)  # dense parts as bf16
    fast = load_model(out, "bfloat16")
    resident = live_weight_bytes(fast)
    assert abs(resident - expected) <= 0.10 * expected, (resident, expected)
    ids = _real_ids(LLM(out, dtype="bfloat16").tokenizer, 128)
    top_fast = runtime_logits(fast, ids).argmax(-1)
    top_ref = runtime_logits(load_model(out, "float32"), ids).argmax(-1)  # dequantize path, fp32
    assert (top_fast == top_ref).float().mean().item() >= 0.95
