"""``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template, answered
whole or streamed."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import FastAPI, Request

from runtime.server.admission import Admission
from runtime.server.prompt_encoder import PromptEncoder
from runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    error_body,
    new_id,
    now,
    sse,
)
from runtime.server.request_runner import RequestRunner, usage


def add_chat_routes(app: FastAPI, runner: RequestRunner, encoder: PromptEncoder, admission: Admission,
                    responses: dict) -> None:
    model_name = runner.model_name

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=responses)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        runner.check_model(req.model)
        prompt = await encoder.render_chat([{"role": m.role, "content": m.text()} for m in req.messages])
        ids = await encoder.encode(prompt, add_special_tokens=False, field="messages")
        max_tokens = admission.check_prompt(len(ids), req.requested_max_tokens())
        params = req.sampling_params(max_tokens, req.logprobs_k())
        rid, created_at = new_id("chatcmpl"), now()
        admission.acquire()
        if req.stream:
            return await runner.stream(events(rid, created_at, req, ids, params, request))
        text, lps, finish, n_out = await runner.collect(ids, params, request)
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish,
                            logprobs=runner.chat_logprobs(lps) if req.logprobs else None)
        return ChatCompletionResponse(id=rid, created=created_at, model=model_name, choices=[choice],
                                      usage=usage(len(ids), n_out))

    async def events(rid, created_at, req: ChatCompletionRequest, ids, params, request) -> AsyncIterator[str]:
        def chunk(choices, usage_info=None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created_at, model=model_name, choices=choices,
                                           usage=usage_info))

        yield chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
        n_out = 0
        try:
            async for step in runner.steps(ids, params, request, poll_disconnect=False):
                n_out = step.completion_tokens
                if not step.text and step.finish_reason is None and not step.logprobs:
                    continue
                lp = runner.chat_logprobs(step.logprobs) if req.logprobs else None
                yield chunk([ChatChunkChoice(delta=DeltaMessage(content=step.text), logprobs=lp,
                                             finish_reason=step.finish_reason)])
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield sse(error_body(f"generation failed: {e}", "server_error"))
        if req.include_usage:
            yield chunk([], usage(len(ids), n_out))
        yield sse("[DONE]")
