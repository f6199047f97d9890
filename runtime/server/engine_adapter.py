"""Drive the real ``Engine`` from its own thread, for the asyncio HTTP layer (an ``EngineClient``).

The event loop never blocks on the engine: submissions and aborts go through a thread-safe inbox
that the step thread drains before each step, and outputs come back to each request's
``asyncio.Queue`` through ``loop.call_soon_threadsafe``. The thread sleeps when idle.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import AsyncIterator

from runtime.engine.engine import Engine, StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.server.engine_client import EngineSnapshot

IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class _Add:
    key: int
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


@dataclass(frozen=True)
class _Abort:
    key: int


class ThreadedEngine:
    """An ``EngineClient`` over ``Engine``: one step thread, asyncio streams per request."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._by_rid: dict[int, _Add] = {}  # engine request id -> its submission (step thread only)
        self._rid_of: dict[int, int] = {}  # our key -> engine request id (step thread only)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- EngineClient --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvslim-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        key = next(self._keys)
        outputs: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Add(key, list(prompt_token_ids), params, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(key))

    def snapshot(self) -> EngineSnapshot:
        # Read from the HTTP thread while the step thread runs: lengths and counters only.
        e = self.engine
        pools = e.block_manager.pools
        return EngineSnapshot(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            blocks_in_use=tuple(p.num_blocks - p.num_free for p in pools),
            blocks_total=tuple(p.num_blocks for p in pools),
            prefix_cache_queried_tokens=e.block_manager.prefix_queried_tokens,
            prefix_cache_hit_tokens=e.block_manager.prefix_hit_tokens,
            num_preemptions=e.stats.preemptions,
        )

    # --- the step thread -----------------------------------------------------------------------
    def _deliver(self, sub: _Add, item) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(msg, _Add):
                try:
                    rid = self.engine.add_request(msg.prompt_token_ids, msg.params)
                except Exception as e:  # refused by the engine (e.g. too long): tell that request only
                    self._deliver(msg, e)
                else:
                    self._by_rid[rid] = msg
                    self._rid_of[msg.key] = rid
            else:
                rid = self._rid_of.pop(msg.key, None)
                if rid is not None and self._by_rid.pop(rid, None) is not None:
                    self.engine.abort(rid)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished)
            if not self.engine.has_unfinished:
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # a failed step fails every request in flight, not the server
                sys.stderr.write(f"engine step failed, {len(self._by_rid)} request(s) aborted: "
                                 f"{type(e).__name__}: {e}\n")
                traceback.print_exc(file=sys.stderr)
                for rid in list(self._by_rid):
                    self.engine.abort(rid)
                    sub = self._by_rid.pop(rid)
                    self._rid_of.pop(sub.key, None)
                    self._deliver(sub, RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
                continue
            for out in outs:
                sub = self._by_rid.get(out.request_id)
                if sub is None:
                    continue
                self._deliver(sub, out)
                if out.finished:
                    del self._by_rid[out.request_id]
                    self._rid_of.pop(sub.key, None)
        for rid in list(self._by_rid):  # stopped with requests left: abort them
            self.engine.abort(rid)
            sub = self._by_rid.pop(rid)
            self._deliver(sub, RuntimeError("the server shut down before this request finished"))
        self._rid_of.clear()
