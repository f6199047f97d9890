"""Request text to prompt token ids, off the event loop.

Tokenizing a megabyte of text takes seconds; it runs in a worker thread (the Rust tokenizer lets
the event loop run meanwhile), and a text that cannot fit the context is refused before it is
tokenized at all where the tokenizer allows a bound: with no normalizer, every token spans at most
``longest_token_bytes`` bytes of input, so ``bytes / longest`` tokens is a floor.
"""
from __future__ import annotations

import math

from starlette.concurrency import run_in_threadpool

from runtime.server.admission import Rejection


def longest_token_bytes(tokenizer) -> int | None:
    """An upper bound on the input bytes one token spans, or ``None`` where the tokenizer
    normalizes its input first (which may shrink it). Token strings over-count: byte-level BPE
    spells some bytes as two-byte characters, SentencePiece a space as the three-byte '▁'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t.encode("utf-8")) for t in tokens if t), default=None)


class PromptEncoder:
    """Token ids for a prompt given as text or ids, checked against the vocabulary and the context."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_model_len = max_model_len
        self.longest_token_bytes = longest_token_bytes(tokenizer)

    async def encode(self, prompt: str | list[int], add_special_tokens: bool, field: str = "prompt") -> list[int]:
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise Rejection(400, f"token id {bad} is out of range: the vocabulary has ids 0..{self.vocab_size - 1}",
                                "invalid_request_error", "invalid_token_id", field)
            return list(prompt)
        self._refuse_if_cannot_fit(prompt, field)
        return await run_in_threadpool(self._tokenize, prompt, add_special_tokens, field)

    async def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied (in a worker thread: a long conversation renders slowly)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise Rejection(400, "this model has no chat template; use /v1/completions",
                            "invalid_request_error", "no_chat_template", "messages")
        return await run_in_threadpool(self._render, messages)

    def _render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. roles out of order) raise jinja errors
            raise Rejection(400, f"the chat template refused the messages: {e}", "invalid_request_error",
                            "invalid_messages", "messages") from e

    def _refuse_if_cannot_fit(self, text: str, field: str) -> None:
        if self.longest_token_bytes is None:
            return
        floor = math.ceil(len(text.encode("utf-8")) / self.longest_token_bytes)
        if floor >= self.max_model_len:
            raise Rejection(400, f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                            f"has at least {floor} tokens ({len(text)} characters)",
                            "invalid_request_error", "context_length_exceeded", field)

    def _tokenize(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError) as e:  # text the request validation let through yet the tokenizer refuses
            raise Rejection(400, f"the tokenizer cannot encode this text: {e}", "invalid_request_error",
                            "invalid_text", field) from e
