"""``POST /v1/completions``: one prompt (text or token ids), answered whole or streamed."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import FastAPI, Request

from runtime.server.admission import Admission
from runtime.server.prompt_encoder import PromptEncoder
from runtime.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    error_body,
    new_id,
    now,
    sse,
)
from runtime.server.request_runner import RequestRunner, usage


def add_completion_routes(app: FastAPI, runner: RequestRunner, encoder: PromptEncoder, admission: Admission,
                          responses: dict) -> None:
    model_name = runner.model_name

    @app.post("/v1/completions", response_model=CompletionResponse, responses=responses)
    async def completions(req: CompletionRequest, request: Request):
        runner.check_model(req.model)
        ids = await encoder.encode(req.prompt_value(), add_special_tokens=True)
        max_tokens = admission.check_prompt(len(ids), req.max_tokens)
        params = req.sampling_params(max_tokens, req.logprobs)
        rid, created_at = new_id("cmpl"), now()
        admission.acquire()
        if req.stream:
            return await runner.stream(events(rid, created_at, req, ids, params, request))
        text, lps, finish, n_out = await runner.collect(ids, params, request)
        choice = CompletionChoice(text=text, finish_reason=finish,
                                  logprobs=runner.completion_logprobs(lps, 0) if req.logprobs is not None else None)
        return CompletionResponse(id=rid, created=created_at, model=model_name, choices=[choice],
                                  usage=usage(len(ids), n_out))

    async def events(rid, created_at, req: CompletionRequest, ids, params, request) -> AsyncIterator[str]:
        yield ": stream opened\n\n"  # an SSE comment; lets the response start before the first token
        base = dict(id=rid, object="text_completion", created=created_at, model=model_name)
        offset, n_out = 0, 0
        try:
            async for step in runner.steps(ids, params, request, poll_disconnect=False):
                n_out = step.completion_tokens
                if not step.text and step.finish_reason is None and not step.logprobs:
                    continue
                lp = (runner.completion_logprobs(step.logprobs, offset).model_dump()
                      if req.logprobs is not None else None)
                offset += len(step.text)
                choice = dict(index=0, text=step.text, logprobs=lp, finish_reason=step.finish_reason)
                yield sse({**base, "choices": [choice], "usage": None})
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield sse(error_body(f"generation failed: {e}", "server_error"))
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(ids), n_out).model_dump()})
        yield sse("[DONE]")
