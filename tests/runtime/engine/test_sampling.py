"""SamplingParams validation and the sampler's filters, seeds and logprobs."""
from __future__ import annotations

import pytest
import torch

from foundation.errors import KvslimError
from runtime.engine.sampling import SamplingParams, find_stop, make_generator, sample


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs"),
])
def test_invalid_params_raise_one_line(kwargs, message):
    with pytest.raises(KvslimError, match=message) as err:
        SamplingParams(**kwargs)
    assert "\n" not in str(err.value)


def test_params_normalise_and_hash():
    p = SamplingParams(stop="\n", stop_token_ids=[3, 4])
    assert p.stop == ("\n",) and p.stop_token_ids == (3, 4)
    assert hash(p) == hash(SamplingParams(stop=["\n"], stop_token_ids=(3, 4)))


def _logits(n=3, v=50, seed=0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_argmax():
    logits = _logits()
    argmax = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        tokens, _ = sample(logits, [p] * 3, [make_generator(SamplingParams(seed=1))] * 3)
        assert tokens == argmax


def test_top_k_and_top_p_restrict_support():
    logits = _logits(1, 20)
    order = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)[order]
    nucleus = int((probs.cumsum(0) < 0.5).sum()) + 1
    seen_k, seen_p = set(), set()
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        seen_k.update(sample(logits, [SamplingParams(top_k=3)], [g])[0])
        seen_p.update(sample(logits, [SamplingParams(top_p=0.5)], [g])[0])
    assert seen_k == set(order[:3])
    assert seen_p == set(order[:nucleus])


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.zeros(3)
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=2.0)], [g])[0][0]] += 1
    expected = torch.softmax(logits[0] / 2.0, -1) * n
    # each count within 5 standard deviations of its binomial mean
    sd = (expected * (1 - expected / n)).sqrt()
    assert ((counts - expected).abs() <= 5 * sd).all(), (counts, expected)


def test_seeds_reproduce():
    logits = _logits(1, 1000)
    draw = lambda seed: [sample(logits, [p], [g])[0][0] for p in [SamplingParams(seed=seed)]
                         for g in [make_generator(p)] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_logprobs_are_the_models_distribution():
    logits = _logits()
    params = [SamplingParams(temperature=0.5, logprobs=2), SamplingParams(temperature=0), SamplingParams(logprobs=0)]
    tokens, lps = sample(logits, params, [None] * 3)
    ref = torch.log_softmax(logits, -1)
    assert lps[1] is None
    for i in (0, 2):
        assert lps[i].token_id == tokens[i]
        assert lps[i].logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
    assert [t for t, _ in lps[0].top] == ref[0].topk(2).indices.tolist()
    assert lps[2].top == ()


def test_find_stop_earliest():
    assert find_stop("abc STOP def END", ("END", "STOP")) == (4, "STOP")
    assert find_stop("abc", ("x",)) is None
