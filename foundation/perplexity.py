"""The one perplexity function: fixed context and stride over a named text range."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm

from foundation.errors import KvslimError

# input_ids [1, T] (int64) -> logits [1, T, vocab]
LogitsFn = Callable[[torch.Tensor], torch.Tensor]
# input_ids [1, T] (int64) -> fp32 [T - 1]: log-probability of token t + 1 at position t (no [T, vocab]
# tensor: what long contexts of large vocabularies need, e.g. Engine.score_targets)
TargetLogprobsFn = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_CONTEXT = 512
DEFAULT_STRIDE = 256
DEFAULT_MAX_TOKENS = 16384
LOGPROB_ROWS = 512  # positions per log-softmax in target_logprobs


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll_sum: float
    num_scored: int
    text: str  # the named range, e.g. "wikipedia:eval"
    num_tokens: int  # tokens of the range used (the first N)
    context: int
    stride: int

    def describe(self) -> str:
        return (
            f"ppl {self.perplexity:.3f} on {self.text}, first {self.num_tokens} tokens, "
            f"context {self.context}, stride {self.stride}"
        )


@torch.no_grad()
def perplexity(
    logits_fn: LogitsFn | None,
    token_ids: torch.Tensor | list[int],
    text: str,
    context: int = DEFAULT_CONTEXT,
    stride: int = DEFAULT_STRIDE,
    progress: bool = False,
    logprobs_fn: TargetLogprobsFn | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity (the transformers recipe).

    Windows of ``context`` tokens start every ``stride`` tokens; each window scores only the tokens
    no earlier window scored, so every token after the first is scored exactly once, with at
    least ``context - stride`` tokens of left context (except in the first window).
    ``logprobs_fn``, when given, scores each window instead of ``logits_fn`` (same numbers, no
    window-sized logits tensor).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    n = ids.numel()
    if n < 2:
        raise KvslimError("perplexity needs at least 2 tokens")
    if not 0 < stride <= context:
        raise KvslimError(f"stride {stride} must be in (0, context={context}]")
    nll_sum, scored, prev_end = 0.0, 0, 0
    starts = list(range(0, n, stride))
    for begin in tqdm(starts, desc=f"ppl {text}", disable=not progress, leave=False):
        end = min(begin + context, n)
        new = end - max(prev_end, begin + 1) if prev_end else end - begin - 1
        window = ids[begin:end].unsqueeze(0)
        if logprobs_fn is not None:
            tok_lp = logprobs_fn(window)
        else:
            logits = logits_fn(window)[0, :-1]
            tok_lp = target_logprobs(logits, window[0, 1:].to(logits.device))
        tok_lp = tok_lp[-new:] if new > 0 else tok_lp[:0]
        nll_sum -= float(tok_lp.sum())
        scored += int(tok_lp.numel())
        prev_end = end
        if end == n:
            break
    return PerplexityResult(math.exp(nll_sum / scored), nll_sum, scored, text, n, context, stride)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, rows: int = LOGPROB_ROWS) -> torch.Tensor:
    """fp32 log-probability of ``targets [T]`` under ``logits [T, vocab]``, ``rows`` positions at a
    time: a log-softmax of the whole window would be a second ``[T, vocab]`` fp32 tensor (8.6 GB at
    8,192 positions of a 262k vocabulary)."""
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=logits.device)
    for a in range(0, targets.shape[0], rows):
        lp = torch.log_softmax(logits[a:a + rows].float(), dim=-1)
        out[a:a + rows] = lp.gather(-1, targets[a:a + rows, None]).squeeze(-1)
    return out


def tokenize_range(tokenizer, text_name: str, max_tokens: int | None = DEFAULT_MAX_TOKENS) -> torch.Tensor:
    """Token ids of a named range (the first ``max_tokens``), without special tokens."""
    from foundation.texts import load_text

    ids = tokenizer(load_text(text_name), add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def hf_logits_fn(model) -> LogitsFn:
    """Wrap a transformers causal LM as a ``LogitsFn``."""

    def fn(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids.to(model.device), use_cache=False).logits

    return fn
