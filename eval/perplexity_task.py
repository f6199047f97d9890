"""The perplexity entries of the eval pack, computed with the shared :func:`foundation.perplexity.perplexity`.

Each entry is a held-out named text range (``wikipedia:eval``, ``pydoc:eval``), the first
``max_tokens`` tokens of it, context 512 / stride 256: the same recipe every kvslim figure uses.
"""
from __future__ import annotations

from dataclasses import dataclass

from foundation.perplexity import (
    DEFAULT_CONTEXT,
    DEFAULT_STRIDE,
    LogitsFn,
    perplexity,
    tokenize_range,
)

# 8,192 tokens: the length DATA.md's reference figure (12.52 on pydoc:eval for the default model) uses.
PERPLEXITY_TOKENS = 8192


@dataclass(frozen=True)
class PerplexityTask:
    """One perplexity entry: a named held-out text range."""

    name: str  # the entry's name in results and tables, e.g. "ppl_wikipedia"
    text: str  # the named range, e.g. "wikipedia:eval"
    max_tokens: int = PERPLEXITY_TOKENS
    context: int = DEFAULT_CONTEXT
    stride: int = DEFAULT_STRIDE


PERPLEXITY_TASKS: dict[str, PerplexityTask] = {
    t.name: t
    for t in (
        PerplexityTask("ppl_wikipedia", "wikipedia:eval"),
        PerplexityTask("ppl_pydoc", "pydoc:eval"),
    )
}


def run_perplexity_task(task: PerplexityTask, logits_fn: LogitsFn, tokenizer, max_tokens: int | None = None) -> dict:
    """Perplexity of one entry as a results row: ``{"perplexity": .., "text": .., "num_tokens": ..}``.

    ``max_tokens`` (``--ppl-tokens``) overrides the entry's length; the row records what was used.
    """
    ids = tokenize_range(tokenizer, task.text, max_tokens=max_tokens or task.max_tokens)
    r = perplexity(logits_fn, ids, task.text, context=task.context, stride=task.stride)
    return {
        "perplexity": r.perplexity,
        "nll_sum": r.nll_sum,
        "num_scored": r.num_scored,
        "text": r.text,
        "num_tokens": r.num_tokens,
        "context": r.context,
        "stride": r.stride,
    }


def check_perplexity_tokens(tokenizer, names: list[str], max_tokens: int) -> None:
    """Refuse ``--ppl-tokens`` longer than a requested entry's text (rather than silently scoring less)."""
    from foundation.errors import KvslimError

    for name in names:
        task = PERPLEXITY_TASKS[name]
        available = tokenize_range(tokenizer, task.text, max_tokens=None).numel()
        if max_tokens > available:
            raise KvslimError(f"--ppl-tokens {max_tokens}: {task.text} ({name}) has only {available} tokens")
