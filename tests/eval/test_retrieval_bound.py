"""The planner's retrieval bound: hits per depth and found answers' log-probability, each against the
original's; and ``served_retrieval`` serving both from one pass."""
import math

import pytest

from eval.retrieval_bound import RetrievalBound, ServedRetrieval

DEPTHS = (0, 0, 50, 50)
ORIGINAL = ServedRetrieval(DEPTHS, (-2.0, -0.2, -0.1, -0.3), (False, True, True, True))


def test_accuracy_is_per_depth():
    assert ORIGINAL.accuracy() == {0: 0.5, 50: 1.0}


def test_the_logprob_drop_counts_only_answers_the_original_finds():
    worse_where_missed = ServedRetrieval(DEPTHS, (-9.0, -0.2, -0.1, -0.3), (False, True, True, True))
    assert worse_where_missed.logprob_drop(ORIGINAL) == 0.0
    worse = ServedRetrieval(DEPTHS, (-2.0, -0.2, -0.6, -0.3), (False, True, True, True))
    assert worse.logprob_drop(ORIGINAL) == pytest.approx(0.5)
    better = ServedRetrieval(DEPTHS, (-1.0, -0.1, -0.05, -0.1), (True, True, True, True))
    assert better.logprob_drop(ORIGINAL) == 0.0
    with pytest.raises(ValueError, match="different prompts"):
        better.logprob_drop(ServedRetrieval((0, 50), (-1.0, -1.0), (True, True)))


def test_the_bound_needs_both_the_hits_and_the_likelihood():
    bound = RetrievalBound()  # 5 points, ln 2 nats per token
    half_as_likely = ServedRetrieval(DEPTHS, (-2.0, -0.2 - math.log(2), -0.1, -0.3), ORIGINAL.hits)
    assert bound.met(half_as_likely, ORIGINAL)
    less = ServedRetrieval(DEPTHS, (-2.0, -0.2 - math.log(2) - 0.01, -0.1, -0.3), ORIGINAL.hits)
    assert not bound.met(less, ORIGINAL) and RetrievalBound(max_logprob_drop=math.inf).met(less, ORIGINAL)
    a_miss = ServedRetrieval(DEPTHS, ORIGINAL.logprobs, (False, True, False, True))
    assert bound.hit_margin(a_miss, ORIGINAL) == -0.5 and not bound.met(a_miss, ORIGINAL)
    assert RetrievalBound(min_retrieval=0.5).met(a_miss, ORIGINAL)


def test_served_retrieval_gives_each_prompts_answer_likelihood_and_hit(tiny_with_tokenizer):
    """On the runtime's cache as a candidate holds it: one mean log-probability and one greedy hit per
    prompt, the hit being what 10 greedy tokens start with."""
    from eval.kv_plan import retrieval_prompts
    from eval.kv_plan_measurements import served_engine, served_retrieval
    from foundation.calibration import load_tokenizer
    from foundation.checkpoint import Checkpoint
    from runtime.engine.sampling import SamplingParams

    ckpt = Checkpoint.open(tiny_with_tokenizer)
    tokenizer = load_tokenizer(ckpt.path)
    prompts = retrieval_prompts(tokenizer, 96)[:3]
    served = served_retrieval(ckpt.path, ckpt.config, "int8", prompts, tokenizer, 96)
    assert served.depths == tuple(p.depth for p in prompts) and len(served.logprobs) == len(served.hits) == 3
    assert all(lp < 0 for lp in served.logprobs)
    ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    with served_engine(ckpt.path, ckpt.config, "int8", 96) as engine:
        outs = engine.generate(ids, SamplingParams(max_tokens=10, temperature=0))
    answers = [tokenizer(p.text + " " + p.answer)["input_ids"][len(i):] for p, i in zip(prompts, ids)]
    assert served.hits == tuple(list(o.token_ids[:len(a)]) == a for o, a in zip(outs, answers))
