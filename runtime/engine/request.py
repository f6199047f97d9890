"""A request's state, shared by the scheduler and the engine (no tensors)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # stop token / EOS
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class Request:
    """One request: its prompt, generated tokens and how much of it the cache holds.

    ``num_computed_tokens`` counts tokens whose K/V is in the cache; preemption resets it to 0
    (recompute), keeping the generated tokens, so the request resumes where it stopped.
    """

    seq_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    sampling: Any = None  # the sampler's SamplingParams, opaque to the scheduler
    use_prefix_cache: bool = True
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
