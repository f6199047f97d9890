"""The perplexity entries of the eval pack, computed with the shared :func:`foundation.perplexity.perplexity`.

Each entry is a held-out named text range (``wikipedia:eval``, ``pydoc:eval``), the first
``max_tokens`` tokens of it, context 512 / stride 256: the same recipe every kvslim figure uses.
``compress eval --text FILE`` adds an entry over a user's own UTF-8 file (``ppl_text``), and
``--ctx N`` scores every entry at context N, stride N / 2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from foundation.errors import KvslimError
from foundation.perplexity import (
    DEFAULT_CONTEXT,
    DEFAULT_STRIDE,
    LogitsFn,
    TargetLogprobsFn,
    perplexity,
    tokenize_range,
)

# 8,192 tokens: the length DATA.md's reference figure (12.52 on pydoc:eval for the default model) uses.
PERPLEXITY_TOKENS = 8192
TEXT_FILE_TASK = "ppl_text"  # the entry of --text FILE


@dataclass(frozen=True)
class PerplexityTask:
    """One perplexity entry: a named held-out text range."""

    name: str  # the entry's name in results and tables, e.g. "ppl_wikipedia"
    text: str  # the named range, e.g. "wikipedia:eval", or the path of a UTF-8 file (``from_file``)
    max_tokens: int | None = PERPLEXITY_TOKENS  # None: the whole text
    context: int = DEFAULT_CONTEXT
    stride: int = DEFAULT_STRIDE
    from_file: bool = False

    @classmethod
    def of_file(cls, path: str | Path) -> "PerplexityTask":
        """The whole of a user's text file (its first ``--ppl-tokens`` tokens when given)."""
        read_text_file(path)  # a bad file is refused before any model loads
        return cls(TEXT_FILE_TASK, str(path), max_tokens=None, from_file=True)

    def at_context(self, context: int) -> "PerplexityTask":
        """The same entry at another context, stride half of it."""
        return replace(self, context=context, stride=max(1, context // 2))

    def token_ids(self, tokenizer, max_tokens: int | None) -> torch.Tensor:
        """The text's first ``max_tokens`` token ids (None: all of them)."""
        if not self.from_file:
            return tokenize_range(tokenizer, self.text, max_tokens=max_tokens)
        ids = tokenizer(read_text_file(self.text), add_special_tokens=False)["input_ids"]
        if len(ids) < 2:
            raise KvslimError(f"--text {self.text}: {len(ids)} token(s); perplexity needs at least 2")
        return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


PERPLEXITY_TASKS: dict[str, PerplexityTask] = {
    t.name: t
    for t in (
        PerplexityTask("ppl_wikipedia", "wikipedia:eval"),
        PerplexityTask("ppl_pydoc", "pydoc:eval"),
    )
}


def run_perplexity_task(task: PerplexityTask, logits_fn: LogitsFn, tokenizer, max_tokens: int | None = None,
                        logprobs_fn: TargetLogprobsFn | None = None) -> dict:
    """Perplexity of one entry as a results row: ``{"perplexity": .., "text": .., "num_tokens": ..}``.

    ``max_tokens`` (``--ppl-tokens``) overrides the entry's length; the row records what was used.
    ``logprobs_fn``: scores instead of ``logits_fn`` (``foundation.perplexity``).
    """
    ids = task.token_ids(tokenizer, max_tokens or task.max_tokens)
    r = perplexity(logits_fn, ids, task.text, context=task.context, stride=task.stride, logprobs_fn=logprobs_fn)
    return {
        "perplexity": r.perplexity,
        "nll_sum": r.nll_sum,
        "num_scored": r.num_scored,
        "text": r.text,
        "num_tokens": r.num_tokens,
        "context": r.context,
        "stride": r.stride,
    }


def check_perplexity_tokens(tokenizer, tasks: list[PerplexityTask], max_tokens: int) -> None:
    """Refuse ``--ppl-tokens`` longer than a requested entry's text (rather than silently scoring less)."""
    for task in tasks:
        available = task.token_ids(tokenizer, None).numel()
        if max_tokens > available:
            raise KvslimError(f"--ppl-tokens {max_tokens}: {task.text} ({task.name}) has only {available} tokens")


def read_text_file(path: str | Path) -> str:
    """A user's text file as a string; missing, unreadable, non-UTF-8 or empty: a one-line error."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise KvslimError(f"--text {p}: no such file") from None
    except IsADirectoryError:
        raise KvslimError(f"--text {p}: is a directory, not a text file") from None
    except OSError as e:
        raise KvslimError(f"--text {p}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise KvslimError(f"--text {p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise KvslimError(f"--text {p}: the file is empty")
    return text
