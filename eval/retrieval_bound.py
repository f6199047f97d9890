"""The KV planner's retrieval bound: a candidate must keep the calibration facts the original finds.

Two prompts a depth (the planner's default) move a hit rate in steps of 50 points, and a candidate
that makes every fact less likely without yet flipping a greedy answer passes a hit bound alone.
So the bound has two parts, both against the original served the same way:
- hits: at every depth, accuracy no more than ``min_retrieval`` below the original's;
- answer log-probability: on every prompt the original answers, the mean log-probability of the
  answer's tokens (teacher-forced, as served) no more than ``max_logprob_drop`` below the original's.
  The default, ln 2, lets a found fact's answer become at most half as likely per token: a round
  figure fixed before any plan was chosen under it, not fitted to a measurement.
A hit is greedy decoding giving exactly the answer's tokens (``eval.retrieval_logprob``), stricter
than the evaluation's "the first number answered is the key".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MIN_RETRIEVAL = 0.05  # at most this far below the original's accuracy at any depth
DEFAULT_MAX_LOGPROB_DROP = math.log(2)  # nats per answer token on a fact the original finds


@dataclass(frozen=True)
class ServedRetrieval:
    """Calibration retrieval served with one cache: per prompt (in the planner's prompt order) its
    depth, the mean log-probability of its answer's tokens, and whether greedy decoding gives them."""
    depths: tuple[int, ...]
    logprobs: tuple[float, ...]
    hits: tuple[bool, ...]

    def accuracy(self) -> dict[int, float]:
        """Depth -> share of its prompts answered."""
        by_depth: dict[int, list[bool]] = {}
        for d, hit in zip(self.depths, self.hits):
            by_depth.setdefault(d, []).append(hit)
        return {d: sum(h) / len(h) for d, h in sorted(by_depth.items())}

    def logprob_drop(self, original: ServedRetrieval) -> float:
        """The largest fall of the answer's log-probability from ``original``'s over the prompts the
        original answers (0.0 where it answers none)."""
        if original.depths != self.depths:
            raise ValueError("retrieval served on different prompts")
        drops = [o - c for c, o, hit in zip(self.logprobs, original.logprobs, original.hits) if hit]
        return max([0.0, *drops])


@dataclass(frozen=True)
class RetrievalBound:
    min_retrieval: float = DEFAULT_MIN_RETRIEVAL
    max_logprob_drop: float = DEFAULT_MAX_LOGPROB_DROP

    def hit_margin(self, served: ServedRetrieval, original: ServedRetrieval) -> float:
        """The smallest (accuracy - original's) over depths; the hit part holds where >= -min_retrieval."""
        mine = served.accuracy()
        return min(mine.get(d, 0.0) - acc for d, acc in original.accuracy().items())

    def met(self, served: ServedRetrieval, original: ServedRetrieval) -> bool:
        return (self.hit_margin(served, original) >= -self.min_retrieval - 1e-9
                and served.logprob_drop(original) <= self.max_logprob_drop + 1e-9)

    def kept(self, served: ServedRetrieval, original: ServedRetrieval) -> str:
        """"0%:50 25%:100 ..., found answers at most 0.55 nats/token less likely": what ``served`` kept."""
        from eval.retrieval_task import by_depth_line

        return (f"{by_depth_line(served.accuracy())}, found answers at most {served.logprob_drop(original):.2f} "
                "nats/token less likely")

    def describe(self) -> str:
        return (f"{100 * self.min_retrieval:g} points of the original's accuracy at every depth, and answers "
                f"it finds at most {self.max_logprob_drop:.2f} nats/token less likely")
