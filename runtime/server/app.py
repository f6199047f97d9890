"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

    app = create_app(engine_client, tokenizer, "smollm2", footprint, api_key=None, max_queue=256)

The engine steps in its own thread (``EngineClient``); handlers only tokenize, submit, and turn
outputs into JSON or server-sent events. A streamed response whose client goes away is closed by
the ASGI server, which closes the engine iterator, which aborts the request and frees its blocks.
No endpoint reads a path or any other server-side resource named by the request.
"""
from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from foundation.errors import KvslimError
from runtime.engine.detokenizer import Detokenizer
from runtime.engine.sampling import SamplingParams, TokenLogprob
from runtime.server.admission import Admission, Rejection
from runtime.server.engine_client import EngineClient
from runtime.server.metrics import KVFootprint, RequestTimer, ServerMetrics
from runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    error_body,
    new_id,
    now,
    sse,
)

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)}


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
    token_texts: dict[int, str] = field(default_factory=dict)


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _field_path(loc: tuple, body: Any, missing: bool) -> str | None:
    """The request field a pydantic error location points at (``messages.0.content``), found by
    walking the body: parts that are not in it (``constrained-str``, ``function-after[...]``,
    which pydantic adds for union members) are dropped; a missing field's name is kept."""
    path, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(loc) - 1 and isinstance(node, dict)):
            continue
        path.append(str(part))
    return ".".join(path) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem with a request body."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind, loc, ctx = first.get("type"), tuple(first.get("loc", ())), first.get("ctx") or {}
    if kind == "json_invalid":  # loc is ("body", character offset)
        return f"invalid JSON body at character {loc[-1]}: {ctx.get('error', 'JSON decode error')}", None
    param = _field_path(loc[1:] if loc[:1] == ("body",) else loc, exc.body, kind == "missing")
    msg = str(ctx["error"]) if kind == "value_error" and "error" in ctx else first.get("msg", "invalid value")
    if param is None and kind in ("model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    return (f"{param}: {msg}" if param else msg), param


class APIKeyMiddleware:
    """Pure ASGI check of ``Authorization: Bearer <key>`` on every path but ``OPEN_PATHS``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        response = _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                          "invalid_request_error", code="invalid_api_key")
        await response(scope, receive, send)


def create_app(
    engine: EngineClient,
    tokenizer,
    model_name: str,
    footprint: KVFootprint,
    api_key: str | None = None,
    max_queue: int = 256,
) -> FastAPI:
    """Build the app around a started-on-demand ``engine`` (started and stopped by the lifespan)."""
    metrics = ServerMetrics(engine.snapshot, footprint)
    admission = Admission(max_queue, engine.max_model_len)
    created = now()
    vocab_size = len(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            admission.draining = True
            await engine.shutdown()

    app = FastAPI(title="kvslim", summary="OpenAI-compatible server for compressed checkpoints", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.admission = admission
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # --- errors in the OpenAI shape ------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        metrics.rejected.labels("invalid").inc()
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(Rejection)
    async def _on_rejection(request: Request, exc: Rejection):
        metrics.rejected.labels(exc.code).inc()
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(KvslimError)
    async def _on_kvslim(request: Request, exc: KvslimError):
        metrics.rejected.labels("invalid").inc()
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception):
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    # --- helpers -------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise Rejection(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                            "invalid_request_error", "model_not_found", "model")

    def encode(prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise Rejection(400, f"token id {bad} is out of range: the vocabulary has ids 0..{vocab_size - 1}",
                                "invalid_request_error", "invalid_token_id", "prompt")
            return list(prompt)
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    async def steps(ids: list[int], params: SamplingParams, request: Request, poll_disconnect: bool) -> AsyncIterator[Step]:
        """Run one request on the engine; yield what each output adds. Closing this aborts it."""
        st = _Stream(Detokenizer.for_params(tokenizer, params), RequestTimer(metrics, time.perf_counter()))
        outputs = engine.generate(ids, params)
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

    def token_str(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def completion_logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in lps:
            tok = token_str(lp.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({token_str(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def chat_logprobs(lps: list[TokenLogprob]) -> ChatLogprobs:
        def entry(t: int, v: float) -> TopLogprob:
            s = token_str(t)
            return TopLogprob(token=s, logprob=v, bytes=list(s.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ])

    def usage(prompt: int, completion: int) -> UsageInfo:
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def stream_response(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect(ids: list[int], params: SamplingParams, request: Request) -> tuple[str, list, str | None, int]:
        """Run an admitted non-streamed request to its end: (text, logprobs, finish_reason, tokens)."""
        text, lps, finish, n_out = "", [], None, 0
        try:
            async for step in steps(ids, params, request, poll_disconnect=True):
                text += step.text
                lps += step.logprobs
                finish, n_out = step.finish_reason, step.completion_tokens
        finally:
            admission.release()
        return text, lps, finish, n_out

    async def admitted(body: AsyncIterator[str]) -> AsyncIterator[str]:
        """Release the admission slot however the body ends."""
        try:
            async for chunk in body:
                yield chunk
        finally:
            await body.aclose()
            admission.release()

    async def start_stream(body: AsyncIterator[str]) -> StreamingResponse:
        # Enter the body before handing it over, so its ``finally`` runs even if the client is
        # gone before the first byte (a started async generator is closed by the event loop).
        gen = admitted(body)
        first = await gen.__anext__()

        async def chained() -> AsyncIterator[str]:
            try:
                yield first
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()

        return stream_response(chained())

    # --- endpoints -----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if admission.draining:
            return _error(503, "the server is shutting down", "server_error", code="shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        ids = encode(req.prompt_value(), add_special_tokens=True)
        max_tokens = admission.check_prompt(len(ids), req.max_tokens)
        params = req.sampling_params(max_tokens, req.logprobs)
        rid, created_at = new_id("cmpl"), now()
        admission.acquire()
        if req.stream:
            return await start_stream(completion_events(rid, created_at, req, ids, params, request))
        text, lps, finish, n_out = await collect(ids, params, request)
        choice = CompletionChoice(text=text, finish_reason=finish,
                                  logprobs=completion_logprobs(lps, 0) if req.logprobs is not None else None)
        return CompletionResponse(id=rid, created=created_at, model=model_name, choices=[choice],
                                  usage=usage(len(ids), n_out))

    async def completion_events(rid, created_at, req: CompletionRequest, ids, params, request) -> AsyncIterator[str]:
        yield ": stream opened\n\n"  # an SSE comment; lets the response start before the first token
        base = dict(id=rid, object="text_completion", created=created_at, model=model_name)
        offset, n_out = 0, 0
        try:
            async for step in steps(ids, params, request, poll_disconnect=False):
                n_out = step.completion_tokens
                if not step.text and step.finish_reason is None and not step.logprobs:
                    continue
                lp = completion_logprobs(step.logprobs, offset).model_dump() if req.logprobs is not None else None
                offset += len(step.text)
                choice = dict(index=0, text=step.text, logprobs=lp, finish_reason=step.finish_reason)
                yield sse({**base, "choices": [choice], "usage": None})
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield sse(error_body(f"generation failed: {e}", "server_error"))
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": usage(len(ids), n_out).model_dump()})
        yield sse("[DONE]")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        if not getattr(tokenizer, "chat_template", None):
            raise Rejection(400, f"the model {model_name!r} has no chat template; use /v1/completions",
                            "invalid_request_error", "no_chat_template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. roles out of order) raise jinja errors
            raise Rejection(400, f"the chat template refused the messages: {e}", "invalid_request_error",
                            "invalid_messages", "messages") from e
        ids = encode(prompt, add_special_tokens=False)
        max_tokens = admission.check_prompt(len(ids), req.requested_max_tokens())
        params = req.sampling_params(max_tokens, req.logprobs_k())
        rid, created_at = new_id("chatcmpl"), now()
        admission.acquire()
        if req.stream:
            return await start_stream(chat_events(rid, created_at, req, ids, params, request))
        text, lps, finish, n_out = await collect(ids, params, request)
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish,
                            logprobs=chat_logprobs(lps) if req.logprobs else None)
        return ChatCompletionResponse(id=rid, created=created_at, model=model_name, choices=[choice],
                                      usage=usage(len(ids), n_out))

    async def chat_events(rid, created_at, req: ChatCompletionRequest, ids, params, request) -> AsyncIterator[str]:
        def chunk(choices, usage_info=None) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created_at, model=model_name, choices=choices,
                                           usage=usage_info))

        yield chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])
        n_out = 0
        try:
            async for step in steps(ids, params, request, poll_disconnect=False):
                n_out = step.completion_tokens
                if not step.text and step.finish_reason is None and not step.logprobs:
                    continue
                lp = chat_logprobs(step.logprobs) if req.logprobs else None
                yield chunk([ChatChunkChoice(delta=DeltaMessage(content=step.text), logprobs=lp,
                                             finish_reason=step.finish_reason)])
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            yield sse(error_body(f"generation failed: {e}", "server_error"))
        if req.include_usage:
            yield chunk([], usage(len(ids), n_out))
        yield sse("[DONE]")

    return app
