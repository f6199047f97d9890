"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

    app = create_app(engine_client, tokenizer, "smollm2", footprint, api_key=None, max_queue=256)

The engine steps in its own thread (``EngineClient``); handlers validate, tokenize (in a worker
thread), submit, and turn outputs into JSON or server-sent events. A streamed response whose client
goes away is closed by the ASGI server, which closes the engine iterator, which aborts the request
and frees its blocks. No endpoint reads a path or any other server-side resource named by the
request. Stalled connections are the HTTP server's to drop (``runtime.server.connections``).
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from runtime.server.admission import Admission
from runtime.server.chat_routes import add_chat_routes
from runtime.server.completion_routes import add_completion_routes
from runtime.server.engine_client import EngineClient
from runtime.server.errors import add_error_handlers, error_response
from runtime.server.limits import DEFAULT_MAX_REQUEST_BYTES
from runtime.server.metrics import KVFootprint, ServerMetrics
from runtime.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from runtime.server.prompt_encoder import PromptEncoder
from runtime.server.protocol import ErrorResponse, ModelCard, ModelList, now
from runtime.server.request_runner import RequestRunner

ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


def create_app(
    engine: EngineClient,
    tokenizer,
    model_name: str,
    footprint: KVFootprint,
    api_key: str | None = None,
    max_queue: int = 256,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """Build the app around a started-on-demand ``engine`` (started and stopped by the lifespan)."""
    metrics = ServerMetrics(engine.snapshot, footprint)
    admission = Admission(max_queue, engine.max_model_len)

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
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)  # added last: runs first
    add_error_handlers(app, metrics)
    _add_service_routes(app, engine, admission, metrics, model_name)
    runner = RequestRunner(engine, tokenizer, model_name, admission, metrics)
    encoder = PromptEncoder(tokenizer, engine.max_model_len)
    add_completion_routes(app, runner, encoder, admission, ERROR_RESPONSES)
    add_chat_routes(app, runner, encoder, admission, ERROR_RESPONSES)
    return app


def _add_service_routes(app: FastAPI, engine: EngineClient, admission: Admission, metrics: ServerMetrics,
                        model_name: str) -> None:
    """Health, Prometheus metrics and the model list: no tokenizer, no engine step."""
    created = now()

    @app.get("/health")
    async def health() -> Response:
        if admission.draining:
            return error_response(503, "the server is shutting down", "server_error", code="shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)])
