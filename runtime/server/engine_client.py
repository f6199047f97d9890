"""What the HTTP layer needs from an engine: streamed generation, abort, and a state snapshot.

``runtime.server.app`` is written against ``EngineClient`` only, so tests can drive the HTTP
layer with a fake; ``runtime.server.engine_adapter`` wraps the real engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from runtime.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from runtime.engine.engine import StepOutput


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state at one instant (read from the HTTP thread for /metrics)."""

    num_running: int
    num_waiting: int
    blocks_in_use: tuple[int, ...]  # per cache group, blocks with a live reference
    blocks_total: tuple[int, ...]
    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # of which served from cached blocks
    num_preemptions: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, over all groups (0..1)."""
        total = sum(self.blocks_total)
        return sum(self.blocks_in_use) / total if total else 0.0


class EngineClient(Protocol):
    max_model_len: int

    def start(self) -> None:
        """Start the engine's step thread."""

    async def shutdown(self) -> None:
        """Stop the step thread (after in-flight requests have drained)."""

    def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Submit a request; yield its output each time it gains tokens, the last one finished.
        Closing the iterator early aborts the request and frees its blocks."""

    def snapshot(self) -> EngineSnapshot: ...
