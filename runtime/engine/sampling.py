"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds, logprobs.

Logprobs are those of the model's own distribution (``log_softmax`` of the raw logits, before
temperature / top-k / top-p), as vLLM reports them. Stop strings are checked on the detokenized
text by ``find_stop``; stop token ids and EOS by the caller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from foundation.errors import KvslimError


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt (vLLM's names and defaults where they exist).

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. ``logprobs``
    (``prompt_logprobs``): ``None`` for none, ``k >= 0`` for the chosen (actual) token's logprob
    plus the ``k`` most likely alternatives, per generated (prompt) token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (or one string) from callers; store tuples so the params stay hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KvslimError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise KvslimError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise KvslimError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise KvslimError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise KvslimError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise KvslimError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise KvslimError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise KvslimError(f"{name} must be None or an integer >= 0, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprob:
    """One position's logprob: the actual token's and the ``top`` alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A private RNG on ``device`` (where the logits are sampled) for a seeded request (``None``:
    torch's global RNG)."""
    return None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Logprobs of ``token_ids [N]`` under ``logits [N, V]`` plus the ``top`` best per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1)).squeeze(1).tolist()
    if top > 0:
        vals, idx = logp.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids.tolist(), chosen, tops)]


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus of a 1-D logits row."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass before it is < top_p (the first token is always kept).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Pick one token per row of ``logits [N, V]`` and its logprob when ``params[i].logprobs``."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    out_lp: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        top = max(params[i].logprobs for i in wanted)
        lps = token_logprobs(logits[wanted], tokens[wanted], top)
        for i, lp in zip(wanted, lps):
            out_lp[i] = TokenLogprob(lp.token_id, lp.logprob, lp.top[: params[i].logprobs])
    return tokens.tolist(), out_lp


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> tuple[int, str] | None:
    """Earliest ``(index, stop)`` of any stop string in ``text[search_from:]``, or ``None``."""
    best = None
    for s in stops:
        j = text.find(s, search_from)
        if j >= 0 and (best is None or j < best[0]):
            best = (j, s)
    return best
