"""``eval.retrieval_logprob`` (and ``benchmarks/kv_retrieval_served_logprob.py`` over it): answer
log-probabilities walked through the cache as served (prompt in prefill chunks, answer a token at a
time), checked against the plain log-softmax of ``Engine.score`` over the same pieces."""
import pytest
import torch

from runtime.engine.engine import Engine, EngineConfig
from runtime.model.loader import load_model


def tiny_engine(path, kv_dtype: str) -> Engine:
    """16-token prefill chunks over 4-token blocks: pieces that span blocks and blocks that span pieces."""
    return Engine(load_model(path, "float32"), EngineConfig(kv_dtype=kv_dtype, block_size=4, max_num_batched_tokens=16,
                                                            max_model_len=128, kv_cache_bytes=2 << 20))


@pytest.fixture(scope="module")
def script():
    import eval.retrieval_logprob

    return eval.retrieval_logprob


def test_pieces_are_prefill_chunks_then_single_tokens(script):
    assert script.served_pieces(2500, 3, 1024) == [1024, 1024, 452, 1, 1, 1]
    assert script.served_pieces(1024, 0, 1024) == [1024]


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_answer_logprobs_are_the_scores_of_the_same_walk(script, tiny_llama, kv_dtype):
    from foundation.perplexity import target_logprobs

    engine = tiny_engine(tiny_llama, kv_dtype)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (37,), generator=g).tolist()
    answer = torch.randint(3, 512, (5,), generator=g).tolist()
    lp, hit = script.answer_logprobs(engine, prompt, answer, prefill_chunk=16)
    walk = engine.score_pieces(prompt + answer[:-1], script.served_pieces(37, 4, 16), exact_new_rows=True)
    logits = torch.cat([rows for _, rows in walk])[36:]
    torch.testing.assert_close(lp, target_logprobs(logits, torch.tensor(answer)), rtol=0, atol=1e-6)
    assert hit == bool((logits.argmax(-1) == torch.tensor(answer)).all())
    greedy = logits[0].argmax().item()  # an answer of the argmax token is a hit
    assert script.answer_logprobs(engine, prompt, [greedy], prefill_chunk=16)[1]


def test_answer_ids_continue_the_prompt(script, tiny_with_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_with_tokenizer)
    prompt, answer = script.answer_ids(tok, "The pass key is", "48213")
    assert tok(" 48213", add_special_tokens=False)["input_ids"][-5:] == answer[-5:]
    assert tok.decode(prompt + answer).endswith("The pass key is 48213")


def test_a_missing_checkpoint_is_one_line():
    import subprocess
    import sys

    from tests.benchmark_scripts import BENCHMARKS

    run = subprocess.run([sys.executable, str(BENCHMARKS / "kv_retrieval_served_logprob.py"), "/no/such/ckpt"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and run.stderr.startswith("error: /no/such/ckpt")


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_score_pieces_from_a_position_are_the_scores_rows_from_it(tiny_llama, kv_dtype):
    """``logits_from`` skips rows, not work: the rows it yields are ``score``'s; ``exact_new_rows``
    reads an INT8 piece's new rows exact, as a served prefill chunk does, and so differs from ``score``."""
    engine = tiny_engine(tiny_llama, kv_dtype)
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    pieces = [16, 16, 8]
    full = engine.score(ids, pieces)
    yielded = list(engine.score_pieces(ids, pieces, logits_from=20))
    assert [first for first, _ in yielded] == [20, 32]
    torch.testing.assert_close(torch.cat([rows for _, rows in yielded]), full[20:], rtol=0, atol=1e-5)
    served = torch.cat([rows for _, rows in engine.score_pieces(ids, pieces, exact_new_rows=True)])
    assert torch.equal(served, full) == (kv_dtype == "fp32")


def test_served_answers_are_each_prompts_mean_and_hit(script, tiny_llama):
    engine = tiny_engine(tiny_llama, "fp32")
    g = torch.Generator().manual_seed(5)
    encoded = [(torch.randint(3, 512, (n,), generator=g).tolist(), torch.randint(3, 512, (3,), generator=g).tolist())
               for n in (20, 33)]
    expected = [script.answer_logprobs(engine, p, a, prefill_chunk=16) for p, a in encoded]
    got = script.served_answers(engine, encoded, prefill_chunk=16)
    assert got == [(float(lp.mean()), hit) for lp, hit in expected]
