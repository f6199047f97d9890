"""Recovery gates: thresholds from gates.yaml, only tasks with signal are gated."""
import pytest

from eval.gates import GATES_FILE, GateConfig, all_passed, check_gates, recovery
from eval.results_cache import EvalResults, TaskScore
from foundation.errors import KvslimError

SETTINGS = {"tasks": ["arc_easy", "winogrande", "ppl_pydoc"], "limits": {"arc_easy": 100, "winogrande": 100}}


def _results(arc: float, wino: float, ppl: float, settings=SETTINGS) -> EvalResults:
    def acc(task, v):
        return TaskScore(task, "acc", v, (v * (1 - v) / 100) ** 0.5, 100, True, {"acc": v})

    scores = {
        "arc_easy": acc("arc_easy", arc),
        "winogrande": acc("winogrande", wino),
        "ppl_pydoc": TaskScore("ppl_pydoc", "perplexity", ppl, None, 512, False, {"perplexity": ppl, "uniform_perplexity": 49152.0}),
    }
    return EvalResults("/x", "0" * 64, "hf", settings, scores, 1.0, 1.0)


def test_every_scheme_loads():
    import yaml

    for scheme in yaml.safe_load(GATES_FILE.read_text())["schemes"]:
        cfg = GateConfig.load(scheme)
        assert 0 < cfg.accuracy <= 1 and 0 < cfg.perplexity <= 1
    with pytest.raises(KvslimError, match="no gate for scheme"):
        GateConfig.load("nonsense")


def test_recovery_direction():
    base = _results(0.6, 0.52, 10.0)
    cand = _results(0.3, 0.52, 20.0)
    assert recovery(base.scores["arc_easy"], cand.scores["arc_easy"]) == pytest.approx(0.5)
    assert recovery(base.scores["ppl_pydoc"], cand.scores["ppl_pydoc"]) == pytest.approx(0.5)


def test_gates_fail_only_on_tasks_with_signal():
    cfg = GateConfig.load("default")
    base = _results(0.60, 0.52, 12.0)  # arc: 7 stderr above chance; winogrande: 0.4 stderr (noise)
    ok = check_gates(base, _results(0.59, 0.40, 12.5), cfg)
    by_task = {g.task: g for g in ok}
    assert by_task["arc_easy"].passed is True
    assert by_task["winogrande"].gated is False and by_task["winogrande"].passed is None
    assert by_task["ppl_pydoc"].passed is True
    assert all_passed(ok)

    bad = check_gates(base, _results(0.30, 0.52, 12.0), cfg)
    assert {g.task for g in bad if g.passed is False} == {"arc_easy"}
    assert not all_passed(bad)
    worse_ppl = check_gates(base, _results(0.60, 0.52, 30.0), cfg)
    assert [g.task for g in worse_ppl if g.passed is False] == ["ppl_pydoc"]


def test_perplexity_no_better_than_uniform_is_not_gated():
    cfg = GateConfig.load("default")
    gates = check_gates(_results(0.6, 0.5, 60000.0), _results(0.6, 0.5, 90000.0), cfg)
    assert {g.task: g.passed for g in gates}["ppl_pydoc"] is None


def test_mismatched_settings_refused():
    other = {**SETTINGS, "limits": {"arc_easy": 50, "winogrande": 100}}
    with pytest.raises(KvslimError, match="different limits"):
        check_gates(_results(0.6, 0.5, 12.0), _results(0.6, 0.5, 12.0, other), GateConfig.load("default"))
