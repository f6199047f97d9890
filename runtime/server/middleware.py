"""Pure ASGI checks that run before a route: the API key, and the request body's size."""
from __future__ import annotations

import hmac

from fastapi import HTTPException

from runtime.server.errors import error_response

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but ``OPEN_PATHS``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(got, self.expected):
            return await self.app(scope, receive, send)
        response = error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  "invalid_request_error", code="invalid_api_key")
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """A 413 for a body over ``max_bytes``: at once from its ``Content-Length``, else (chunked) as
    soon as the bytes read pass the limit. The connection is closed after the 413, since the rest
    of the body is never read."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(413, self._too_large(), "invalid_request_error", code="request_too_large")
            response.headers["connection"] = "close"
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises an HTTPException from the body read
                    raise HTTPException(413, self._too_large(), headers={"connection": "close"})
            return message

        await self.app(scope, limited_receive, send)
