"""Recovery gates: a compressed checkpoint's scores against its baseline, per scheme (``gates.yaml``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from eval.results_cache import EvalResults, TaskScore
from foundation.errors import KvslimError

GATES_FILE = Path(__file__).with_name("gates.yaml")


@dataclass(frozen=True)
class GateConfig:
    """The thresholds of one scheme and the chance levels that decide which tasks are gated."""

    scheme: str
    accuracy: float  # minimum recovery of accuracy-like metrics
    perplexity: float  # minimum recovery (baseline / candidate) of perplexities
    chance: dict[str, float]
    min_stderr_above_chance: float

    @classmethod
    def load(cls, scheme: str = "default", path: Path = GATES_FILE) -> "GateConfig":
        cfg = yaml.safe_load(path.read_text())
        schemes = cfg["schemes"]
        if scheme not in schemes:
            raise KvslimError(f"no gate for scheme {scheme!r} in {path.name}; known: {', '.join(schemes)}")
        return cls(
            scheme=scheme,
            accuracy=float(schemes[scheme]["accuracy"]),
            perplexity=float(schemes[scheme]["perplexity"]),
            chance={k: float(v) for k, v in cfg["chance"].items()},
            min_stderr_above_chance=float(cfg["min_stderr_above_chance"]),
        )


@dataclass(frozen=True)
class GateResult:
    """One task's recovery and whether it passed its gate (``passed`` is None when not gated)."""

    task: str
    metric: str
    baseline: float
    candidate: float
    recovery: float
    threshold: float
    gated: bool
    reason: str  # why it is or is not gated
    passed: bool | None


def recovery(base: TaskScore, cand: TaskScore) -> float:
    """candidate / baseline for higher-is-better metrics, baseline / candidate otherwise."""
    num, den = (cand.value, base.value) if base.higher_is_better else (base.value, cand.value)
    if den == 0:
        return math.inf if num > 0 else 1.0
    return num / den


def _signal(base: TaskScore, cfg: GateConfig) -> tuple[bool, str]:
    """Whether the baseline carries enough signal on this task to gate it, and why."""
    if not base.higher_is_better:
        uniform = base.metrics.get("uniform_perplexity")
        if uniform is None:
            return False, "no uniform perplexity recorded"
        if base.value < uniform:
            return True, f"baseline ppl {base.value:.4g} < uniform {uniform:.0f}"
        return False, f"baseline ppl {base.value:.4g} no better than uniform {uniform:.0f}"
    chance = cfg.chance.get(base.task)
    if chance is None or base.stderr is None or base.stderr == 0:
        return False, "no chance level or stderr"
    margin = (base.value - chance) / base.stderr
    ok = margin >= cfg.min_stderr_above_chance
    return ok, f"baseline {margin:.1f} stderr {'>=' if ok else '<'} {cfg.min_stderr_above_chance:g} above chance {chance:g}"


def check_gates(baseline: EvalResults, candidate: EvalResults, cfg: GateConfig) -> list[GateResult]:
    """Recovery of every task of ``candidate`` against ``baseline``, gated per ``cfg``."""
    keys = ("tasks", "limits", "perplexity_tokens", "perplexity_context", "text_file", "seed", "pack_version")
    diff = [k for k in keys if baseline.settings.get(k) != candidate.settings.get(k)]
    if diff:
        raise KvslimError(f"baseline and candidate were evaluated with different {', '.join(diff)}")
    results = []
    for task, cand in candidate.scores.items():
        base = baseline.scores[task]
        rec = recovery(base, cand)
        threshold = cfg.accuracy if base.higher_is_better else cfg.perplexity
        gated, reason = _signal(base, cfg)
        passed = (rec >= threshold) if gated else None
        results.append(GateResult(task, cand.metric, base.value, cand.value, rec, threshold, gated, reason, passed))
    return results


def all_passed(results: list[GateResult]) -> bool:
    return all(r.passed is not False for r in results)
