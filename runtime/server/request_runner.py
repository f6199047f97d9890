"""One admitted request run on the engine: its outputs as steps, collected or streamed, with the
logprobs and usage shapes both endpoints answer in."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.engine.detokenizer import Detokenizer
from runtime.engine.sampling import SamplingParams, TokenLogprob
from runtime.server.admission import Admission, Rejection
from runtime.server.engine_client import EngineClient
from runtime.server.metrics import RequestTimer, ServerMetrics
from runtime.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob, UsageInfo


@dataclass
class Step:
    """What one engine output adds to a response."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Stream:
    """Bookkeeping for one request's engine stream."""

    detok: Detokenizer
    timer: RequestTimer
    num_logprobs_sent: int = 0


class RequestRunner:
    """What the completion and chat routes share: the model check, the admission slot, the engine
    stream, and the response pieces built from it."""

    def __init__(self, engine: EngineClient, tokenizer, model_name: str, admission: Admission, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.admission, self.metrics = admission, metrics

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise Rejection(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                            "invalid_request_error", "model_not_found", "model")

    async def steps(self, ids: list[int], params: SamplingParams, request: Request,
                    poll_disconnect: bool) -> AsyncIterator[Step]:
        """Run one request on the engine; yield what each output adds. Closing this aborts it."""
        st = _Stream(Detokenizer.for_params(self.tokenizer, params), RequestTimer(self.metrics, time.perf_counter()))
        outputs = self.engine.generate(ids, params)
        finish, n_out = "abort", 0
        try:
            async for out in outputs:
                st.timer.tokens(len(out.new_token_ids), time.perf_counter())
                n_out = len(out.token_ids)
                text = st.detok.update(out.token_ids, out.finished)
                lps = list(out.logprobs[st.num_logprobs_sent:]) if out.logprobs is not None else []
                st.num_logprobs_sent += len(lps)
                done = out.finished or st.detok.stopped
                finish = "stop" if st.detok.stopped else out.finish_reason
                yield Step(text, lps, finish if done else None, len(ids), n_out)
                if done:
                    break
                if poll_disconnect and await request.is_disconnected():
                    finish = "abort"
                    break
        finally:
            await outputs.aclose()
            st.timer.finish(len(ids), finish or "abort", time.perf_counter())

    async def collect(self, ids: list[int], params: SamplingParams,
                      request: Request) -> tuple[str, list, str | None, int]:
        """Run an admitted non-streamed request to its end: (text, logprobs, finish_reason, tokens)."""
        text, lps, finish, n_out = "", [], None, 0
        try:
            async for step in self.steps(ids, params, request, poll_disconnect=True):
                text += step.text
                lps += step.logprobs
                finish, n_out = step.finish_reason, step.completion_tokens
        finally:
            self.admission.release()
        return text, lps, finish, n_out

    async def stream(self, body: AsyncIterator[str]) -> StreamingResponse:
        """Serve an admitted request's events as server-sent events; the slot is released however
        the body ends. The body is entered before it is handed over, so its ``finally`` runs even
        if the client is gone before the first byte (a started async generator is closed by the
        event loop)."""
        gen = self._released_after(body)
        first = await gen.__anext__()

        async def chained() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()

        return StreamingResponse(chained(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _released_after(self, body: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            await body.aclose()
            self.admission.release()

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            tok = self.token_str(lp.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_str(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        def entry(t: int, v: float) -> TopLogprob:
            s = self.token_str(t)
            return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                             top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ])


def usage(prompt: int, completion: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
