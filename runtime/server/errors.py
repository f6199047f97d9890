"""Errors in the OpenAI shape: every failure a client can cause is a 4xx with a message naming the
problem and, where there is one, the request field (``param``) it is about."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from foundation.errors import KvslimError
from runtime.server.admission import Rejection
from runtime.server.metrics import ServerMetrics
from runtime.server.protocol import error_body


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
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


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem with a request body."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind, loc, ctx = first.get("type"), tuple(first.get("loc", ())), first.get("ctx") or {}
    if kind == "json_invalid":  # loc is ("body", character offset)
        return f"invalid JSON body at character {loc[-1]}: {ctx.get('error', 'JSON decode error')}", None
    if kind == "invalid_text":  # protocol.unencodable_text found it and knows the field
        return first["msg"], ctx.get("path") or None
    param = _field_path(loc[1:] if loc[:1] == ("body",) else loc, exc.body, kind == "missing")
    msg = str(ctx["error"]) if kind == "value_error" and "error" in ctx else first.get("msg", "invalid value")
    if param is None and kind in ("model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    return (f"{param}: {msg}" if param else msg), param


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Validation errors, admission refusals and KvslimErrors become 4xx; anything else a 500
    without a traceback (the fuzz tests and the soak hold that none is reachable)."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        metrics.rejected.labels("invalid").inc()
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(Rejection)
    async def _on_rejection(request: Request, exc: Rejection):
        metrics.rejected.labels(exc.code).inc()
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(KvslimError)
    async def _on_kvslim(request: Request, exc: KvslimError):
        metrics.rejected.labels("invalid").inc()
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        response = error_response(exc.status_code, str(exc.detail), type_)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")
