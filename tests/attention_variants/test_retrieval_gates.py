"""Retrieval gates: at 1 the model is unchanged; at 0 a head streams as the runtime serves it; the
score is the gradient of the answer's log-probability with respect to the gate."""
import json

import pytest
import torch

from attention_variants.retrieval_gates import GatedAttention, answer_logprob, pruned_gate_order, retrieval_gate_scores

WINDOW, SINKS = 8, 2


@pytest.fixture(scope="module")
def model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def ids(n: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@torch.no_grad()
def test_gates_at_one_leave_the_model_as_it_is(model):
    x = torch.tensor([ids(40)])
    before = model(input_ids=x).logits
    gated = GatedAttention(model, (WINDOW,), SINKS)
    try:
        during = model(input_ids=x).logits
    finally:
        gated.remove()
    torch.testing.assert_close(during, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(input_ids=x).logits, before, atol=0, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("row_chunk", [1024, 16])
def test_a_gate_at_zero_streams_its_head_as_the_runtime_serves_it(model, tiny_llama, monkeypatch, row_chunk):
    """The gated branch is the runtime's streaming head: the same log-probabilities (fp32 KV), its
    query rows streamed at once or in chunks."""
    import attention_variants.retrieval_gates as retrieval_gates
    from eval.kv_plan_measurements import served_engine
    from foundation.attention_layout import STREAMING_KEY

    monkeypatch.setattr(retrieval_gates, "ROW_CHUNK", row_chunk)
    config = json.loads((tiny_llama / "config.json").read_text())
    layer, head = 1, 0
    kv_heads = [[head] if i == layer else [] for i in range(config["num_hidden_layers"])]
    streaming = {**config, STREAMING_KEY: {"window": WINDOW, "sinks": SINKS, "kv_heads": kv_heads}}
    tokens = ids(40)
    gated = GatedAttention(model, (WINDOW,), SINKS)
    try:
        gated.gates[WINDOW][layer, head] = 0.0
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    finally:
        gated.remove()
    ours = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    with served_engine(tiny_llama, streaming, "fp32", len(tokens)) as engine:
        served = engine.score_targets(tokens)
    torch.testing.assert_close(ours, served, atol=1e-4, rtol=1e-4)
    with served_engine(tiny_llama, config, "fp32", len(tokens)) as engine:
        assert (engine.score_targets(tokens) - served).abs().max() > 1e-3  # the head's stream does change them


def closing_slope(model, prompt, answer, head: tuple[int, int], at=None, eps: float = 1e-3) -> float:
    """The answer's log-probability lost per unit of ``head``'s gate closed by ``eps`` from ``at``
    (every gate 1 when None): a finite difference to hold the gradient against."""
    gated = GatedAttention(model, (WINDOW,), SINKS, None if at is None else {WINDOW: at})
    try:
        with torch.no_grad():
            base = answer_logprob(model, prompt, answer)
            gated.gates[WINDOW][head] = gated.gates[WINDOW][head] - eps
            nudged = answer_logprob(model, prompt, answer)
    finally:
        gated.remove()
    return float(base - nudged) / eps


def test_the_score_is_the_answers_log_probability_gradient(model):
    prompt, answer = ids(30), ids(3)
    scores = retrieval_gate_scores(model, [(prompt, answer)], (WINDOW, 64), SINKS)
    assert set(scores) == {WINDOW, 64}
    assert torch.count_nonzero(scores[64]) == 0  # a window longer than the prompt streams nothing
    top = divmod(int(scores[WINDOW].abs().flatten().argmax()), scores[WINDOW].shape[1])
    assert closing_slope(model, prompt, answer, top) == pytest.approx(float(scores[WINDOW][top]), rel=0.05, abs=1e-4)
    assert all(p.requires_grad for p in model.parameters())  # the model is left trainable as it was


def test_scores_at_given_gates_are_the_gradient_there(model):
    """With some heads already streaming (``at``), the scores are the gradient at that point."""
    prompt, answer = ids(30), ids(3)
    at = torch.ones(model.config.num_hidden_layers, model.config.num_key_value_heads)
    at[0, :] = 0.0
    scores = retrieval_gate_scores(model, [(prompt, answer)], (WINDOW,), SINKS, {WINDOW: at})[WINDOW]
    top = divmod(int(scores[1:].abs().flatten().argmax()) + at.shape[1], at.shape[1])
    assert closing_slope(model, prompt, answer, top, at) == pytest.approx(float(scores[top]), rel=0.05, abs=1e-4)
    assert torch.equal(at[0], torch.zeros(at.shape[1]))  # the caller's gates are not touched


def test_the_pruned_order_streams_the_lowest_scores_and_re_scores(model, monkeypatch):
    """Each step streams the lowest-scored share of the heads still full and scores again with them
    streaming; the order is every head once: the last full first, then the streamed, last first."""
    import attention_variants.retrieval_gates as retrieval_gates

    n, kvh = model.config.num_hidden_layers, model.config.num_key_value_heads
    seen = []
    real = retrieval_gates.retrieval_gate_scores

    def spy(model, encoded, windows, sinks, at=None):
        seen.append(None if at is None else at[windows[0]].clone())
        return real(model, encoded, windows, sinks, at)

    monkeypatch.setattr(retrieval_gates, "retrieval_gate_scores", spy)
    order = pruned_gate_order(model, [(ids(30), ids(3))], WINDOW, SINKS, share=0.5)
    assert sorted(order) == [(layer, h) for layer in range(n) for h in range(kvh)]
    assert seen[0] is None and all(int(a.sum()) < n * kvh for a in seen[1:])
    fulls = [n * kvh] + [int(a.sum()) for a in seen[1:]]
    assert fulls == sorted(fulls, reverse=True) and fulls[-1] == 1 and len(set(fulls)) == len(fulls)
    last = seen[-1]
    assert order[0] == tuple(last.nonzero()[0].tolist())  # the one left full ranks first
    first_step = real(model, [(ids(30), ids(3))], (WINDOW,), SINKS)[WINDOW]
    lowest = min(((layer, h) for layer in range(n) for h in range(kvh)), key=lambda lh: first_step[lh].item())
    assert order[-1] == lowest  # streamed first, ranked last
    with pytest.raises(ValueError, match="share"):
        pruned_gate_order(model, [(ids(30), ids(3))], WINDOW, SINKS, share=1.0)


def test_the_ranking_benchmark_compares_the_rankings_at_the_same_bytes(tiny_with_tokenizer, tmp_path, capsys):
    from tests.benchmark_scripts import load_benchmark

    out = tmp_path / "ranking.json"
    bench = load_benchmark("streaming_heads_ranking")
    assert bench.main([str(tiny_with_tokenizer), "--ctx", "64", "--window", "16", "--budget", "0.7",
                       "--kv-dtype", "bf16", "--samples", "1", "--pruned-gate", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranking"] for r in rows] == ["bf16, full attention", "mass", "retrieval", "gate", "pruned gate"]
    assert len({r["kv_bytes_per_token"] for r in rows[1:]}) == 1 and "| gate |" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--window", "64"], ["--budget", "1.5"], ["--samples", "0"]])
def test_the_ranking_benchmark_refuses_bad_settings_in_one_line(tiny_with_tokenizer, capsys, flags):
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("streaming_heads_ranking")
    assert bench.main([str(tiny_with_tokenizer), "--ctx", "64", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: need 0 < --window") and err.count("\n") == 1
