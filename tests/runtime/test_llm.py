"""LLM: generation, logprobs and scoring on tiny checkpoints, against transformers; bad input."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from foundation.errors import CheckpointError, KvslimError, UnsupportedArchitecture
from runtime.engine.sampling import SamplingParams
from runtime.llm import LLM
from tests.runtime.hf_oracle import (  # noqa: F401
    assert_greedy_matches_hf,
    hf_logits,
    hf_model,
    single_thread,
)
from tests.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 300, 42, 7], [1, 2, 3], list(range(100, 130))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_llm(tiny_checkpoints):
    return LLM(tiny_checkpoints["llama"])


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3"])
def test_greedy_equals_transformers(tiny_checkpoints, arch):
    llm = LLM(tiny_checkpoints[arch])
    hf = hf_model(tiny_checkpoints[arch])
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == tuple(prompt)
        assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"
        assert assert_greedy_matches_hf(hf, prompt, list(out.outputs[0].token_ids)) == 12


def test_batched_equals_one_by_one(llama_llm):
    together = [o.outputs[0].token_ids for o in llama_llm.generate(PROMPTS, GREEDY)]
    alone = [llama_llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    small_waves = LLM(llama_llm.path, max_num_seqs=1, prefill_chunk=7)
    assert [o.outputs[0].token_ids for o in small_waves.generate(PROMPTS, GREEDY)] == together


def test_one_engine_is_kept_across_calls_and_grows_when_needed(tiny_checkpoints):
    llm = LLM(tiny_checkpoints["llama"])
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    engine = llm._engine_kept
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == first[:1]
    assert llm._engine_kept is engine  # smaller work: the same engine (and its prefix cache)
    longer = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate(PROMPTS, longer)
    assert llm._engine_kept is not engine and llm._engine_size >= (len(PROMPTS[2]) + 200, len(PROMPTS))
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == first
    assert not llm._engine_kept.has_unfinished


def test_prompt_and_token_logprobs_equal_transformers(llama_llm, tiny_checkpoints):
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llama_llm.generate([prompt], params)[0]
    completion = out.outputs[0]
    full = list(prompt) + list(completion.token_ids)
    ref = torch.log_softmax(hf_logits(hf_model(tiny_checkpoints["llama"]), torch.tensor(full)), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        lp = out.prompt_logprobs[t]
        assert lp.token_id == prompt[t]
        assert lp.logprob == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
        assert [i for i, _ in lp.top] == ref[t - 1].topk(2).indices.tolist()
    for j, lp in enumerate(completion.logprobs):
        pos = len(prompt) - 1 + j
        assert lp.token_id == completion.token_ids[j] and len(lp.top) == 3
        assert lp.logprob == pytest.approx(ref[pos, lp.token_id].item(), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))


def test_score_equals_transformers(llama_llm, tiny_checkpoints):
    hf = hf_model(tiny_checkpoints["llama"])
    one = llama_llm.score(PROMPTS[0])
    assert (one - hf_logits(hf, torch.tensor(PROMPTS[0]))).abs().max() <= 1e-4
    many = llama_llm.score(PROMPTS)
    for p, got in zip(PROMPTS, many):
        assert (got - hf_logits(hf, torch.tensor(p))).abs().max() <= 1e-4
    chunked = LLM(llama_llm.path, prefill_chunk=8).score(PROMPTS[2])  # longer than a chunk
    assert (chunked - hf_logits(hf, torch.tensor(PROMPTS[2]))).abs().max() <= 1e-4


def test_seeded_sampling_reproduces(llama_llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True)
    a = llama_llm.generate(PROMPTS, p)
    b = llama_llm.generate(PROMPTS, p)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    c = llama_llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_stop_tokens_eos_and_context_limit(llama_llm):
    greedy = llama_llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    stop_at = greedy[3]
    out = llama_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))
    first = greedy.index(stop_at)
    assert out[0].outputs[0].token_ids == greedy[: first + 1] and out[0].outputs[0].finish_reason == "stop"
    short = LLM(llama_llm.path, max_model_len=len(PROMPTS[0]) + 4)
    out = short.generate([PROMPTS[0]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    with pytest.raises(KvslimError, match="longer than the context of 9"):
        short.generate([list(range(10))], GREEDY)
    with pytest.raises(KvslimError, match="longer than the context"):
        short.score(list(range(10)))


def test_eos_from_generation_config_stops(tiny_checkpoints, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "eos", "llama")
    greedy = LLM(path).generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[2]]}))
    out = LLM(path).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(greedy[2]) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("prompt,message", [
    ("", "prompt 0 is empty"), ([], "prompt 0 is empty"), ([1, 99999], "token ids must be integers"),
    ("hello", "no tokenizer"),
])
def test_bad_prompts_raise_one_line(llama_llm, prompt, message):
    with pytest.raises(KvslimError, match=message) as err:
        llama_llm.generate([prompt], GREEDY)
    assert "\n" not in str(err.value)


def test_bad_arguments(llama_llm):
    with pytest.raises(KvslimError, match="2 sampling params for 3 prompts"):
        llama_llm.generate(PROMPTS, [GREEDY, GREEDY])
    with pytest.raises(KvslimError, match="not SamplingParams"):
        llama_llm.generate([PROMPTS[0]], [{"temperature": 0}])
    with pytest.raises(KvslimError, match="max_model_len"):
        LLM(llama_llm.path, max_model_len=10**6)
    with pytest.raises(KvslimError, match="dtype"):
        LLM(llama_llm.path, dtype="int8")


def _copy(src, dst, drop=(), config_changes=None):
    dst.mkdir()
    weights = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = {**json.loads((src / "config.json").read_text()), **(config_changes or {})}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_checkpoints_it_cannot_serve(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    with pytest.raises(CheckpointError, match="missing tensor model.layers.0.mlp.up_proj.weight"):
        LLM(_copy(src, tmp_path / "a", drop=("model.layers.0.mlp.up_proj.weight",)))
    with pytest.raises(UnsupportedArchitecture, match="not supported"):
        LLM(_copy(src, tmp_path / "b", config_changes={"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(CheckpointError, match="has an unexpected bias"):
        LLM(_with_extra(src, tmp_path / "c", "model.layers.0.mlp.up_proj.bias", torch.zeros(256)))
    with pytest.raises(CheckpointError, match="does not understand: model.extra.weight"):
        LLM(_with_extra(src, tmp_path / "d", "model.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="up_proj.weight has dtype I8, expected a floating-point dtype"):
        LLM(_with_extra(src, tmp_path / "e", "model.layers.0.mlp.up_proj.weight", torch.zeros(256, 128, dtype=torch.int8)))


def _with_extra(src, dst, name, tensor):
    out = _copy(src, dst)
    weights = load_file(out / "model.safetensors")
    weights[name] = tensor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_weight_and_kv_facts(llama_llm):
    n_params = sum(t.numel() for t in load_file(llama_llm.path / "model.safetensors").values())
    assert llama_llm.weight_bytes() == 4 * n_params
    # 4 layers x 2 (K, V) x 2 heads x 32 dims x 4 bytes
    assert llama_llm.kv_bytes_per_token(100) == 4 * 2 * 2 * 32 * 4


def test_tied_checkpoint_may_carry_a_redundant_lm_head(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["gemma3_text"]  # tied
    embed = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    llm = LLM(_with_extra(src, tmp_path / "tied", "lm_head.weight", embed.clone()))
    assert (llm.score(PROMPTS[0]) - LLM(src).score(PROMPTS[0])).abs().max() == 0


def test_stream_ends_with_generate_outputs(llama_llm):
    """The streaming iterator runs the same engine path: its last update per prompt is generate's output."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    last = {}
    for i, out in llama_llm.stream(prompts, params):
        if last.get(i) is not None:
            assert len(out.outputs[0].token_ids) >= len(last[i].outputs[0].token_ids)
        last[i] = out
    assert [last[i] for i in range(len(prompts))] == llama_llm.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6 for o in last.values())
