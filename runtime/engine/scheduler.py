"""Continuous batching: which sequences run this step and how many of their tokens (no tensors).

Every step spends a token budget (``max_num_batched_tokens``): first on running sequences, in
arrival order (one token each when decoding, a chunk when their prefill is unfinished), then on
waiting ones, FCFS, while ``max_num_seqs`` allows and their blocks fit (chunked prefill: a long
prompt takes several steps). When a running sequence cannot get a block, the most recently
admitted running sequence is preempted by recompute: its blocks are freed, it keeps its generated
tokens and goes back to the front of the queue (the prefix cache usually gives its blocks back).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from foundation.errors import KvslimError
from runtime.engine.block_manager import BlockManager
from runtime.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048

    def __post_init__(self):
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise KvslimError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Request
    first_position: int  # position of the first new token (= tokens already cached)
    num_new_tokens: int
    samples: bool  # the chunk reaches the sequence's last token: the step samples its next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Request) -> None:
        if seq.num_prompt_tokens < 1:
            raise KvslimError(f"request {seq.seq_id}: empty prompt")
        if seq.num_tokens >= self.config.max_model_len:
            raise KvslimError(
                f"request {seq.seq_id}: prompt of {seq.num_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        if seq.max_tokens < 1:
            raise KvslimError(f"request {seq.seq_id}: max_tokens must be at least 1")
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Request | None:
        """Drop a request wherever it is; returns it (status aborted) or None if unknown."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                seq.status = RequestStatus.FINISHED_ABORTED
                return seq
        for seq in self.running:
            if seq.seq_id == seq_id:
                self._finish(seq, RequestStatus.FINISHED_ABORTED)
                return seq
        return None

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            self.bm.release_window(seq.seq_id, start)
            while not self.bm.append(seq.seq_id, start, start + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, start, n, start + n == seq.num_tokens))
                budget -= n
                i += 1
                continue
            break
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.bm.lookup_prefix(seq.token_ids) if seq.use_prefix_cache else self.bm.no_hit()
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.bm.allocate(seq.seq_id, hit, hit.num_tokens + n):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                self.bm.record_prefix_lookup(seq.num_prompt_tokens, hit.num_tokens)
            seq.num_computed_tokens = seq.num_cached_tokens = hit.num_tokens
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, hit.num_tokens, n, hit.num_tokens + n == seq.num_tokens))
            budget -= n
        return out

    def postprocess(self, out: SchedulerOutput, sampled: Mapping[int, int]) -> list[Request]:
        """Advance the scheduled sequences; append ``sampled[seq_id]`` where the step sampled.
        Returns the sequences that finished this step (their blocks are freed)."""
        finished = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.first_position + s.num_new_tokens
            if self.bm.commit_due(seq.seq_id, seq.num_computed_tokens):  # a block filled: index it
                self.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if not s.samples:
                continue
            token = sampled[seq.seq_id]
            seq.output_token_ids.append(token)
            status = self._stop_status(seq, token)
            if status is not None:
                self._finish(seq, status)
                finished.append(seq)
        return finished

    def _stop_status(self, seq: Request, token: int) -> RequestStatus | None:
        if token in seq.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, seq: Request) -> None:
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish(self, seq: Request, status: RequestStatus) -> None:
        self.running.remove(seq)
        self.bm.free(seq.seq_id)
        seq.status = status
