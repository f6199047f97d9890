"""The engine on the real default model and real text (slow): against the runtime core in a
batch of 16 mixed-length requests with prefix hits and preemptions, and FP8 KV perplexity."""
import pytest
import torch

from foundation.perplexity import perplexity, tokenize_range
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.llm import LLM
from tests.runtime.engine.test_engine_tiny import assert_same

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def core(default_model_dir):
    return LLM(default_model_dir, max_model_len=512)


@pytest.fixture(scope="module")
def eval_ids(core):
    return tokenize_range(core.tokenizer, "wikipedia:eval", max_tokens=4096).tolist()


def test_batch_of_16_with_prefix_hits_and_preemption(core, eval_ids):
    shared = eval_ids[:48]  # a shared "system prompt" (3 blocks of 16)
    lens = [5, 60, 17, 33, 1, 90, 12, 41, 8, 70, 25, 3, 50, 19, 66, 9]
    prompts = []
    for i, n in enumerate(lens):
        own = eval_ids[200 + 97 * i: 200 + 97 * i + n]
        prompts.append(shared + own if i % 2 == 0 else own)
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3, ignore_eos=True)
    ref = core.generate(prompts, params)
    # 40 blocks of 16 tokens (640 slots) for ~1,000 tokens of requests: preemption is forced.
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    engine = Engine(core.model, EngineConfig(block_size=16, max_num_batched_tokens=128, max_model_len=512,
                                             kv_cache_bytes=40 * block_bytes, max_num_seqs=16))
    assert engine.cache.num_blocks == (40,)
    out = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0 and engine.block_manager.prefix_hit_rate > 0
    for e, r in zip(out, ref):
        assert_same(e, r, tol=2e-3)  # fp32; real logits are larger than the tiny model's
    assert engine.block_manager.pools[0].num_free == 40


def test_fp8_kv_perplexity_within_one_percent_of_bf16(core, eval_ids):
    ids = torch.tensor(eval_ids[:1024])
    ppl = {}
    for kv in ("bf16", "fp8_e4m3"):
        engine = Engine(core.model, EngineConfig(kv_dtype=kv, max_num_batched_tokens=512, max_model_len=512,
                                                 kv_cache_bytes=64 << 20))
        ppl[kv] = perplexity(lambda x: engine.score(x[0])[None], ids, "wikipedia:eval").perplexity
    assert ppl["fp8_e4m3"] <= 1.01 * ppl["bf16"], ppl
