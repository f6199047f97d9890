"""The KV planner on a tiny random Llama with the default model's tokenizer (real calibration text):
budgets hold by allocation, the plan is written and read back, and bad requests are one line."""
import argparse
import json
import math

import pytest

from eval.kv_plan import (KvChoice, candidates, full_heads, layer_bytes, original_bytes, plan_kv,
                          write_planned_checkpoint)
from eval.retrieval_bound import ServedRetrieval
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.kv_plan_file import PLAN_FILE, planned_kv_dtype, read_plan

CTX = 64
WINDOWS = (32, 16)


def test_layer_bytes_are_the_allocators(tiny_llama):
    """bf16 full attention: 2 (K, V) x 2 KV heads x 32 dims x 2 bytes per layer; a sliding layer
    ends a 64-token sequence holding its sinks' block and the window's block (blocks of 16)."""
    config = Checkpoint.open(tiny_llama).config
    full, sliding = layer_bytes(config, "bf16", 16, CTX)
    assert full == 2 * 2 * 32 * 2
    assert sliding == full * 32 / 64
    int4_full, _ = layer_bytes(config, "int4", None, CTX)
    assert int4_full < full / 3


@pytest.mark.parametrize("budget", [0.9, 0.5, 0.3, 0.2])
def test_no_candidate_exceeds_its_budget(tiny_llama, budget):
    config = Checkpoint.open(tiny_llama).config
    original = original_bytes(config, CTX)
    assert original == layer_bytes(config, "bf16", None, CTX)[0] * 4
    ranking = {w: [3, 1, 0, 2] for w in WINDOWS}
    cands = candidates(config, CTX, budget * original, ranking, original)
    assert cands, budget
    for c in cands:
        assert c.kv_bytes_per_token <= budget * original
        assert c.times_smaller == pytest.approx(original / c.kv_bytes_per_token)
        if c.choice.window is not None:  # the most-ranked layers stay full
            g = len(c.choice.global_layers)
            assert set(c.choice.global_layers) == set(ranking[c.choice.window][:g])
    assert [c.kv_bytes_per_token for c in cands] == sorted(c.kv_bytes_per_token for c in cands)


@pytest.mark.parametrize("budget", [0.9, 0.7, 0.55])  # bf16: every head streaming is 0.5 here
def test_streaming_head_candidates_fit_and_keep_the_most_ranked_heads_full(tiny_llama, budget):
    config = Checkpoint.open(tiny_llama).config
    original = original_bytes(config, CTX)
    heads = [(3, 1), (1, 0), (0, 0), (2, 1), (3, 0), (1, 1), (0, 1), (2, 0)]
    cands = candidates(config, CTX, budget * original, {}, original, ("bf16",), {w: heads for w in WINDOWS})
    by_head = [c for c in cands if c.choice.streaming is not None]
    assert by_head or budget == 0.55
    every_head_streaming = [c for c in cands
                            if c.choice.window and not c.choice.global_layers and not c.choice.streaming]
    assert by_head or every_head_streaming
    assert len(every_head_streaming) == len({c.choice.window for c in every_head_streaming})  # one each, as layers
    for c in by_head:
        assert c.kv_bytes_per_token <= budget * original
        full = {(layer, h) for layer in range(4) for h in range(2) if h not in c.choice.streaming[layer]}
        assert full == set(heads[:len(full)])
        config_heads = c.choice.config(config)["streaming_heads"]
        assert config_heads["window"] == c.choice.window and config_heads["sinks"] == 4


def test_a_kv_dtype_mix_buys_more_full_heads(tiny_llama):
    """int4/int2 (windowed KV at 2 bits) keeps at least as many heads full as int4 under one budget,
    counts its bytes per group, and offers no full-attention point of its own (that is int4's)."""
    config = Checkpoint.open(tiny_llama).config
    original = original_bytes(config, CTX)
    heads = [(3, 1), (1, 0), (0, 0), (2, 1), (3, 0), (1, 1), (0, 1), (2, 0)]
    budget = 0.3 * original

    def most_full(dtype: str) -> int:
        cands = candidates(config, CTX, budget, {}, original, (dtype,), {w: heads for w in WINDOWS})
        assert all(c.choice.kv_dtype == dtype and c.kv_bytes_per_token <= budget for c in cands)
        if "/" in dtype:
            assert all(c.choice.window is not None for c in cands)
        return max(8 - sum(map(len, c.choice.streaming)) for c in cands if c.choice.streaming is not None)

    assert most_full("int4/int2") >= most_full("int4")
    _, windowed = layer_bytes(config, "int4/int2", WINDOWS[0], CTX)
    assert windowed == layer_bytes(config, "int2", WINDOWS[0], CTX)[1]


def test_a_kv_dtype_mix_with_a_retrieval_ranking_offers_bits_per_head(tiny_llama, tmp_path):
    """HIGH/LOW by head over the whole context: the most top-ranked heads in HIGH the budget allows
    (one more would not fit), by allocation; without a budget a fifth and two fifths of them."""
    from eval.kv_plan import KvPlan, allocated_bytes

    config = Checkpoint.open(tiny_llama).config
    original = original_bytes(config, CTX)
    ranked = [(3, 1), (1, 0), (0, 0), (2, 1), (3, 0), (1, 1), (0, 1), (2, 0)]
    budget = 0.22 * original

    def by_head(budget_bytes):
        return [c for c in candidates(config, CTX, budget_bytes, {}, original, ("int4/int2",), None, ranked)
                if c.choice.whole_context]

    (best,), ladder = by_head(budget), by_head(None)
    kept = {(layer, h) for layer in range(4) for h in range(2) if h not in best.choice.streaming[layer]}
    assert best.kv_bytes_per_token <= budget and kept == set(ranked[:len(kept)]) and 1 <= len(kept) < 8
    one_more = set(ranked[:len(kept) + 1])
    lowered = tuple(tuple(h for h in range(2) if (layer, h) not in one_more) for layer in range(4))
    more = KvChoice("int4/int2", 512, (), 0, lowered, "retrieval", whole_context=True)
    assert allocated_bytes(more.config(config), "int4/int2", CTX) > budget
    assert [8 - sum(map(len, c.choice.streaming)) for c in ladder] == [1, 3]
    assert best.choice.describe(4) == (f"int4/int2 KV by head: {8 - len(kept)} KV heads in int2, the rest in int4 "
                                       "(by retrieval), whole context")
    assert not by_head(0.01 * original)  # not one head fits
    assert not [c for c in candidates(config, CTX, budget, {}, original, ("int4",), None, ranked) if c.choice.whole_context]

    plan = KvPlan(CTX, 0.22, None, 4, original, 10.0, best, (best,), "calib", "dev")
    out = write_planned_checkpoint(tiny_llama, plan, tmp_path / "by_head")
    assert json.loads((out / "config.json").read_text())["streaming_heads"]["window"] == 512


def test_convert_takes_a_kv_dtype_mix_and_refuses_a_bad_one(capsys):
    from cli.commands.convert import plan_kv_dtype_arg

    assert plan_kv_dtype_arg("int4/int2") == "int4/int2" and plan_kv_dtype_arg("int4/int4") == "int4"
    assert plan_kv_dtype_arg("k4v2") == "k4v2" and plan_kv_dtype_arg("k4v2/int2") == "k4v2/int2"  # when asked
    assert plan_kv_dtype_arg("k3v2") == "k3v2"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown KV dtype 'int4/fp8'"):
        plan_kv_dtype_arg("int4/fp8")


def test_plan_is_served_written_and_read_back(tiny_with_tokenizer, tmp_path):
    plan = plan_kv(tiny_with_tokenizer, budget=0.4, ctx=CTX, windows=WINDOWS, dtypes=("bf16", "int4"))
    assert plan.chosen.kv_bytes_per_token <= 0.4 * plan.original_kv_bytes_per_token
    assert all(c.dev_ppl is not None for c in plan.candidates)
    assert plan.chosen.dev_ppl == min(c.dev_ppl for c in plan.candidates)
    out = write_planned_checkpoint(tiny_with_tokenizer, plan, tmp_path / "planned")
    doc = read_plan(out)
    assert doc["kv_cache_dtype"] == plan.kv_cache_dtype == planned_kv_dtype(out)
    assert doc["times_smaller"] >= 2.5
    config = json.loads((out / "config.json").read_text())
    if plan.chosen.choice.streaming is not None:
        assert config["streaming_heads"]["kv_heads"] == [list(h) for h in plan.chosen.choice.streaming]
    elif plan.chosen.choice.window is not None:
        assert config["sliding_window"] == plan.chosen.choice.window and config["num_sink_tokens"] == 4
    assert any(c.choice.streaming is not None for c in plan.candidates)  # heads planned beside layers

    # The written checkpoint, allocated at the planned dtype, holds what the plan counted.
    from runtime.cache.kv_report import report_variant

    held = report_variant("planned", config, plan.kv_cache_dtype, 8 << 20, seq_len=CTX).counted_bytes_per_token
    assert held == pytest.approx(plan.chosen.kv_bytes_per_token) and held <= 0.4 * plan.original_kv_bytes_per_token

    # The runtime serves the planned KV dtype by default.
    from runtime.engine.engine import Engine, EngineConfig

    engine = Engine.from_checkpoint(out, EngineConfig(max_model_len=CTX, kv_cache_bytes=8 << 20))
    assert {g.kv_dtype for g in engine.kv_spec.groups} == {plan.kv_cache_dtype}


def test_max_ppl_increase_takes_the_fewest_bytes_that_pass(tiny_with_tokenizer):
    plan = plan_kv(tiny_with_tokenizer, max_ppl_increase=0.5, ctx=CTX, windows=(32,), dtypes=("bf16", "int8"))
    passing = [c for c in plan.candidates if c.dev_ppl <= 1.5 * plan.original_dev_ppl]
    assert plan.chosen == passing[0] == plan.candidates[-1]  # served in order of bytes, stopped at the first pass
    assert all(c.kv_bytes_per_token <= plan.chosen.kv_bytes_per_token for c in plan.candidates)


@pytest.mark.parametrize("kw,match", [
    (dict(budget=0.0), "in \\(0, 1\\]"),
    (dict(budget=1.5), "in \\(0, 1\\]"),
    (dict(budget=0.5, max_ppl_increase=0.1), "exactly one"),
    (dict(), "exactly one"),
    (dict(max_ppl_increase=-1.0), "0 or more"),
    (dict(budget=0.5, ctx=100000), "context"),
    (dict(budget=0.001), "no KV plan fits"),
])
def test_bad_requests_are_one_line(tiny_with_tokenizer, kw, match):
    kw = {"ctx": CTX, "windows": WINDOWS, **kw}
    with pytest.raises(KvslimError, match=match):
        plan_kv(tiny_with_tokenizer, **kw)


def test_a_bad_plan_file_is_one_line(tmp_path):
    (tmp_path / PLAN_FILE).write_text("{not json")
    with pytest.raises(KvslimError, match="unreadable KV plan"):
        read_plan(tmp_path)
    (tmp_path / PLAN_FILE).write_text(json.dumps({"kv_cache_dtype": "int3"}))
    with pytest.raises(KvslimError, match="needs kv_cache_dtype"):
        planned_kv_dtype(tmp_path)
    assert KvChoice("int4").config({"a": 1}) == {"a": 1}


def test_a_gate_ranking_chooses_the_full_heads(tiny_llama):
    """With retrieval prompts (a retrieval bound), the full heads are the ones whose streaming would
    cost the calibration answers most, not those with the most mass beyond the window."""
    config = Checkpoint.open(tiny_llama).config
    original = original_bytes(config, CTX)
    mass = [(3, 1), (1, 0), (0, 0), (2, 1), (3, 0), (1, 1), (0, 1), (2, 0)]
    gates = list(reversed(mass))
    for ranking, by in ((None, "mass"), ({16: gates}, "retrieval gate")):
        heads = [c for c in candidates(config, CTX, 0.7 * original, {}, original, ("bf16",), {16: mass},
                                       gate_ranking=ranking) if c.choice.streaming is not None]
        assert heads and {c.choice.heads_by for c in heads} == {by}
        for c in heads:
            full = {(layer, h) for layer in range(4) for h in range(2) if h not in c.choice.streaming[layer]}
            assert full == set((gates if ranking else mass)[:len(full)]) and f"full heads by {by}" in c.choice.describe(4)


def test_the_heads_are_ranked_on_prompts_the_bound_never_checks(tiny_with_tokenizer):
    from eval.kv_plan import RANKING_DEPTHS, RETRIEVAL_CALIB, ranking_prompts, retrieval_prompts
    from foundation.calibration import load_tokenizer

    tokenizer = load_tokenizer(tiny_with_tokenizer)
    for samples in (1, 2):
        checked = {p.text for p in retrieval_prompts(tokenizer, CTX, samples)}
        ranked = ranking_prompts(tokenizer, CTX, samples)
        assert len(ranked) == len(RETRIEVAL_CALIB) * len(RANKING_DEPTHS) and not checked & {p.text for p in ranked}
        assert [p.depth for p in ranked] == list(RANKING_DEPTHS) * len(RETRIEVAL_CALIB)


def _fake_retrieval(monkeypatch, passes, logprob=lambda config, kv_dtype: -0.1):
    """served_retrieval answering by candidate: every prompt where ``passes(config, kv_dtype)``, else
    all but those at depth 0; each answer's log-probability ``logprob(config, kv_dtype)``."""
    import eval.kv_plan as kv_plan

    def served(model_dir, config, kv_dtype, prompts, tokenizer, ctx):
        ok = passes(config, kv_dtype)
        return ServedRetrieval(tuple(p.depth for p in prompts), tuple(logprob(config, kv_dtype) for _ in prompts),
                               tuple(ok or p.depth > 0 for p in prompts))
    monkeypatch.setattr(kv_plan, "served_retrieval", served)
    ranked = [(layer, h) for layer in range(4) for h in range(2)]
    monkeypatch.setattr(kv_plan, "retrieval_rank", lambda *a: ranked)
    monkeypatch.setattr(kv_plan, "gate_rank", lambda model_dir, tokenizer, prompts, windows, sinks, pruned_down_to=None:
                        {w: ranked if pruned_down_to is None else ranked[::-1] for w in windows})  # pruned: 3 first


def _is_original(config: dict, kv_dtype: str) -> bool:
    return kv_dtype == "bf16" and "sliding_window" not in config and "streaming_heads" not in config


def test_a_budget_plan_takes_the_best_perplexity_within_the_retrieval_bound(tiny_with_tokenizer, monkeypatch):
    _fake_retrieval(monkeypatch, lambda config, kv: _is_original(config, kv) or kv == "int8")
    plan = plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("bf16", "int8", "int4"))
    assert plan.chosen.choice.kv_dtype == "int8" and plan.retrieval_bound_met
    better = [c for c in plan.candidates if c.dev_ppl < plan.chosen.dev_ppl]
    assert all(c.retrieval is not None and c.retrieval.accuracy()[0] == 0.0 for c in better)  # served, refused
    doc = json.loads(plan.to_json())
    assert doc["retrieval_bound_met"] is True and doc["min_retrieval"] == 0.05
    assert doc["max_logprob_drop"] == pytest.approx(math.log(2)) and doc["retrieval_logprob_drop"] == 0.0
    assert len(doc["retrieval_logprobs"]) == len(doc["original_retrieval_logprobs"]) == 10
    assert "passkey_calib" in doc["retrieval_prompts"]


def test_a_candidate_that_keeps_the_hits_but_makes_the_answers_unlikely_is_refused(tiny_with_tokenizer, monkeypatch):
    """Every greedy answer kept, but int8's answers ln 2 + 0.1 nats/token less likely than the
    original's: the bound refuses int8 (the best dev perplexity here) for int4, and with
    ``max_logprob_drop`` inf (hits alone) int8 passes."""
    _fake_retrieval(monkeypatch, lambda config, kv: True,
                    lambda config, kv: -0.1 - (math.log(2) + 0.1) * (kv == "int8"))
    plan = plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8", "int4"))
    assert plan.chosen.choice.kv_dtype == "int4" and plan.retrieval_bound_met
    refused = [c for c in plan.candidates if c.retrieval is not None and c.choice.kv_dtype == "int8"]
    assert refused and all(c.retrieval.logprob_drop(plan.original_retrieval) > math.log(2) for c in refused)
    drops = [c["retrieval_logprob_drop"] for c in json.loads(plan.to_json())["candidates"] if c["kv_dtype"] == "int8"]
    assert max(d for d in drops if d is not None) == pytest.approx(math.log(2) + 0.1, abs=1e-3)
    hits_alone = plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8", "int4"),
                         max_logprob_drop=math.inf)
    assert hits_alone.chosen.choice.kv_dtype == "int8" and hits_alone.retrieval_bound_met
    assert json.loads(hits_alone.to_json())["max_logprob_drop"] is None
    with pytest.raises(KvslimError, match="--max-logprob-drop -1"):
        plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8",), max_logprob_drop=-1)


def test_retrieval_samples_set_the_calibration_prompts(tiny_with_tokenizer, monkeypatch):
    """``retrieval_samples`` prompts per calibration task and depth reach the served check, and a
    count below 1 is one line."""
    import eval.kv_plan as kv_plan

    seen = []
    _fake_retrieval(monkeypatch, lambda config, kv: True)
    served = kv_plan.served_retrieval
    monkeypatch.setattr(kv_plan, "served_retrieval", lambda *a: seen.append(len(a[3])) or served(*a))
    plan = plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8",), retrieval_samples=3)
    per_check = 3 * len(kv_plan.RETRIEVAL_CALIB) * len(kv_plan.RETRIEVAL_DEPTHS)
    assert seen and set(seen) == {per_check} and plan.retrieval_prompts.startswith(f"{per_check} prompts")
    with pytest.raises(KvslimError, match="--retrieval-samples must be a positive integer"):
        plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8",), retrieval_samples=0)


def test_a_budget_plan_missing_the_bound_keeps_the_most_retrieval_and_says_so(tiny_with_tokenizer, monkeypatch):
    _fake_retrieval(monkeypatch, _is_original)
    plan = plan_kv(tiny_with_tokenizer, budget=0.3, ctx=CTX, windows=(16,), dtypes=("int8", "int4"))
    assert plan.retrieval_bound_met is False and json.loads(plan.to_json())["retrieval_bound_met"] is False


def test_when_every_candidate_misses_the_heads_are_ranked_again_with_the_gates_pruned(tiny_with_tokenizer, monkeypatch):
    """Where no candidate keeps retrieval, the gates are re-measured as heads stream (down to the
    full heads the budget buys) and those candidates are served and checked too; one within the
    bound is chosen."""
    from eval.kv_plan import PRUNED_GATE_RANKED
    from foundation.attention_layout import STREAMING_KEY

    def layer3_full(config: dict, kv_dtype: str) -> bool:
        return _is_original(config, kv_dtype) or STREAMING_KEY in config and config[STREAMING_KEY]["kv_heads"][3] == []

    _fake_retrieval(monkeypatch, layer3_full)
    plan = plan_kv(tiny_with_tokenizer, budget=0.6, ctx=CTX, windows=(16,), dtypes=("int8",))
    assert plan.retrieval_bound_met and plan.chosen.choice.heads_by == PRUNED_GATE_RANKED
    assert f"full heads by {PRUNED_GATE_RANKED}" in json.loads(plan.to_json())["choice"]
    gate = [c for c in plan.candidates if c.choice.heads_by == "retrieval gate"]
    assert gate and all(c.retrieval is not None and not plan.bound.met(c.retrieval, plan.original_retrieval)
                        for c in gate)
    assert full_heads(plan.chosen.choice, 2) == full_heads(gate[0].choice, 2)  # as many heads, other ones


def test_missing_the_bound_the_best_worst_depth_wins_then_dev_perplexity(tiny_with_tokenizer, monkeypatch):
    """Where every candidate misses the bound, more hits at other depths do not outweigh dev
    perplexity: among those whose worst depth keeps the most, the lowest dev perplexity wins."""
    import eval.kv_plan as kv_plan

    calls = []

    def served(model_dir, config, kv_dtype, prompts, tokenizer, ctx):
        calls.append(kv_dtype)  # the original first, then candidates by dev perplexity, best first
        lost = set() if len(calls) == 1 else {0, 25} if len(calls) == 2 else {0}
        return ServedRetrieval(tuple(p.depth for p in prompts), tuple(-0.1 for _ in prompts),
                               tuple(p.depth not in lost for p in prompts))

    _fake_retrieval(monkeypatch, _is_original)
    monkeypatch.setattr(kv_plan, "served_retrieval", served)
    plan = plan_kv(tiny_with_tokenizer, budget=0.3, ctx=CTX, windows=(16,), dtypes=("int8", "int4"))
    checked = [c for c in plan.candidates if c.retrieval is not None]
    assert len(checked) >= 2 and plan.retrieval_bound_met is False
    assert plan.chosen.dev_ppl == min(c.dev_ppl for c in checked)  # though another answered more
    assert sum(plan.chosen.retrieval.hits) < max(sum(c.retrieval.hits) for c in checked)


def test_a_quality_plan_that_no_candidate_keeps_retrieval_for_is_one_line(tiny_with_tokenizer, monkeypatch):
    _fake_retrieval(monkeypatch, _is_original)
    with pytest.raises(KvslimError, match="keeps calibration retrieval within 5 points"):
        plan_kv(tiny_with_tokenizer, max_ppl_increase=10.0, ctx=CTX, windows=(32,), dtypes=("int8",))
    plan = plan_kv(tiny_with_tokenizer, max_ppl_increase=10.0, ctx=CTX, windows=(32,), dtypes=("int8",),
                   min_retrieval=None)
    assert plan.chosen.retrieval is None and plan.retrieval_bound_met is None


@pytest.mark.parametrize("flag", [["--min-retrieval", "0.1"], ["--max-logprob-drop", "1"], ["--kv-dtypes", "int4"],
                                  ["--retrieval-samples", "4"], ["--plan-windows", "128"]])
def test_plan_flags_without_a_plan_are_one_line(tiny_with_tokenizer, tmp_path, capsys, flag):
    from cli.main import main

    assert main(["convert", str(tiny_with_tokenizer), "--mqa", *flag, "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and "applies to a KV plan" in err and err.count("\n") == 1


def test_the_cli_refuses_zero_retrieval_samples_in_one_line(tiny_with_tokenizer, tmp_path, capsys):
    from cli.main import main

    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.4", "--ctx", str(CTX),
                 "--retrieval-samples", "0", "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--retrieval-samples must be a positive integer, got 0" in err and err.count("\n") == 1


def test_the_cli_plans_among_the_given_windows(tiny_with_tokenizer, tmp_path, capsys, monkeypatch):
    from cli.main import main

    _fake_retrieval(monkeypatch, lambda config, kv: True)
    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.6", "--ctx", str(CTX), "--kv-dtypes", "int8",
                 "--plan-windows", "8", "-o", str(tmp_path / "p")]) == 0
    windows = {c["window"] for c in json.loads((tmp_path / "p" / "plan.json").read_text())["candidates"]}
    assert windows <= {None, 8} and 8 in windows
    capsys.readouterr()
    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.6", "--ctx", str(CTX),
                 "--plan-windows", "0", "-o", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "--plan-windows must be positive token counts, got 0" in err and err.count("\n") == 1
    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.6", "--ctx", str(CTX),
                 "--plan-windows", "8", str(CTX), "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"--plan-windows {CTX} is not below the plan's context {CTX}" in err and err.count("\n") == 1


def test_the_cli_plans_among_the_given_dtypes(tiny_with_tokenizer, tmp_path, capsys):
    from cli.main import main

    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.4", "--ctx", str(CTX), "--kv-dtypes", "int4",
                 "--min-retrieval", "1", "-o", str(tmp_path / "p")]) == 0
    doc = read_plan(tmp_path / "p")
    assert doc["kv_cache_dtype"] == "int4" and {c["kv_dtype"] for c in doc["candidates"]} == {"int4"}
    assert doc["min_retrieval"] is None and "calibration retrieval" not in capsys.readouterr().out
