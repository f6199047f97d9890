"""Admission control: which requests reach the engine.

A request is refused before it costs anything when the server already holds ``max_queue``
requests (429), when its prompt leaves no room under ``max_model_len`` (400), or when the server
is draining for shutdown (503). Admitted requests hold a slot until their response ends, however
it ends (finished, aborted by a client disconnect, or failed).
"""
from __future__ import annotations


class Rejection(Exception):
    """A request refused with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


class Admission:
    """A bounded count of in-flight requests (used from the event loop only, so no lock)."""

    def __init__(self, max_queue: int, max_model_len: int):
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.max_queue = max_queue
        self.max_model_len = max_model_len
        self.in_flight = 0
        self.draining = False

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Validate the prompt length; return ``max_tokens`` (``None``: all the room left)."""
        room = self.max_model_len - num_prompt_tokens
        if num_prompt_tokens < 1:
            raise Rejection(400, "the prompt is empty", "invalid_request_error", "empty_prompt", "prompt")
        if room < 1:
            raise Rejection(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{num_prompt_tokens} tokens, leaving no room to generate",
                "invalid_request_error", "context_length_exceeded", "prompt")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise Rejection(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} to generate)",
                "invalid_request_error", "context_length_exceeded", "max_tokens")
        return max_tokens

    def acquire(self) -> None:
        """Take one in-flight slot, or raise a 429 / 503 ``Rejection``. Pair with ``release``."""
        if self.draining:
            raise Rejection(503, "the server is shutting down", "server_error", "shutting_down")
        if self.in_flight >= self.max_queue:
            raise Rejection(429, f"the server holds its maximum of {self.max_queue} requests; retry later",
                            "rate_limit_error", "queue_full")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        assert self.in_flight >= 0, "admission slot released twice"
