import math

import pytest
import torch

from foundation.errors import KvslimError
from foundation.perplexity import perplexity, target_logprobs


def _uniform(vocab):
    return lambda ids: torch.zeros(1, ids.shape[1], vocab)


def _bigram(table):
    """A model whose next-token distribution depends only on the current token."""
    return lambda ids: table[ids[0]].unsqueeze(0)


def test_uniform_model_has_perplexity_vocab_size():
    r = perplexity(_uniform(37), torch.arange(100) % 37, "synthetic", context=16, stride=8)
    assert r.perplexity == pytest.approx(37.0, rel=1e-6)
    assert r.num_scored == 99  # every token after the first, once


@pytest.mark.parametrize("context, stride", [(8, 8), (8, 3), (16, 5), (200, 50)])
def test_every_token_scored_once_whatever_the_windows(context, stride):
    torch.manual_seed(0)
    table = torch.randn(11, 11)
    ids = torch.randint(0, 11, (103,))
    r = perplexity(_bigram(table), ids, "synthetic", context=context, stride=stride)
    lp = torch.log_softmax(table, -1)
    expected = -sum(float(lp[a, b]) for a, b in zip(ids[:-1].tolist(), ids[1:].tolist()))
    # stride == context leaves each window's first token without a predecessor in the window
    lost = 0 if stride < context else len(range(context, 103, stride))
    if lost == 0:
        assert r.num_scored == 102
        assert r.nll_sum == pytest.approx(expected, rel=1e-5)
    else:
        assert r.num_scored == 102 - lost


def test_single_window_equals_the_model_loss(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1))
    r = perplexity(lambda x: model(input_ids=x).logits, ids, "synthetic", context=64, stride=64)
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss
    assert math.log(r.perplexity) == pytest.approx(float(loss), rel=1e-5)


def test_bad_arguments():
    with pytest.raises(KvslimError, match="at least 2 tokens"):
        perplexity(_uniform(3), [1], "x")
    with pytest.raises(KvslimError, match="stride"):
        perplexity(_uniform(3), [1, 2, 3], "x", context=4, stride=5)


def test_target_logprobs_in_row_chunks_equal_one_log_softmax():
    """Chunked so that a long window of a large vocabulary never holds a second [T, vocab] tensor."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 101, generator=g, dtype=torch.float64).to(torch.bfloat16)
    targets = torch.randint(0, 101, (37,), generator=g)
    whole = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    for rows in (1, 8, 37, 512):
        assert torch.equal(target_logprobs(logits, targets, rows), whole)
