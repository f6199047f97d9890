"""The OpenAI wire format: request and response models (pydantic), and the error shape.

Requests are validated here; a field outside its range becomes a 400 in OpenAI's error JSON
``{"error": {"message", "type", "param", "code"}}``. Only what the engine implements is accepted:
one choice (``n=1``), no penalties, no ``echo``/``best_of``. Types are strict, as in the OpenAI API:
an integer field takes a JSON integer (not ``"5"`` or ``true``), a boolean a JSON boolean. Unknown
extra fields are ignored, as the OpenAI API does. ``ignore_eos`` and ``top_k`` (-1 or 0: off) are
vLLM's extensions (the load generator uses ``ignore_eos`` to fix output lengths).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from runtime.engine.sampling import SamplingParams

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 256
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


# Strict: no "5" -> 5 or true -> 1 coercion; floats still take JSON integers.
REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True)


def _only(supported: Any) -> AfterValidator:
    """A field typed strictly (``true`` is not 1) that admits one value, as this server implements it."""
    def check(v: Any) -> Any:
        if v != supported:
            raise ValueError(f"only {json.dumps(supported)} is supported")
        return v
    return AfterValidator(check)


class StreamOptions(BaseModel):
    model_config = REQUEST_CONFIG
    include_usage: bool = False


StopField = Union[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)],
                  Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]],
                            Field(max_length=MAX_STOP_STRINGS)], None]


def unencodable_text(body: Any) -> tuple[str, str] | None:
    """(field path, problem) for the first string of a request body, keys included, that is not
    valid Unicode: a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes can carry and no
    tokenizer takes. Walked without recursion (a body can nest deeper than Python's stack)."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if (at := _surrogate_at(value)) is not None:
                return _dotted(path), (f"contains a lone UTF-16 surrogate (\\u{ord(value[at]):04x}) at character "
                                       f"{at}; text must be valid Unicode")
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        children = []
        for key, item in items:
            if isinstance(key, str) and _surrogate_at(key) is not None:
                return _dotted(path) or "body", f"the field name '{_printable(key)}' is not valid Unicode"
            if isinstance(item, (str, list, dict)):
                children.append((item, (*path, key)))
        stack.extend(reversed(children))  # the first field is looked at first
    return None


def _dotted(path: tuple) -> str:
    return ".".join(_printable(k) for k in path)


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _printable(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class _SamplingFields(BaseModel):
    """Fields common to both endpoints."""

    model_config = REQUEST_CONFIG

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """Every string of the body, before any field: the tokenizer must never see invalid text."""
        found = unencodable_text(data)
        if found:
            path, problem = found
            raise PydanticCustomError("invalid_text", "{path}: {problem}", {"path": path, "problem": problem})
        return data

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: StopField = None
    n: Annotated[int, _only(1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, _only(0)] = 0.0
    frequency_penalty: Annotated[float, _only(0)] = 0.0
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        """Name the problem (the union's own error says "not a string" for any bad list)."""
        if v is None:
            return v
        strings = [v] if isinstance(v, str) else v
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError("must be a string or a list of strings")
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(strings)}")
        if not all(strings):
            raise ValueError("stop strings must not be empty")
        if max(map(len, strings), default=0) > MAX_STOP_LEN:
            raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_tuple(cls, v):
        if v is None:
            return ()
        return (v,) if isinstance(v, str) else tuple(v)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k or 0, 0),  # -1 (vLLM) and 0 both mean no top-k
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop or (),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


TokenIds = Annotated[list[int], Field(min_length=1)]  # the range is checked against the vocabulary


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: Union[Annotated[str, Field(min_length=1)], TokenIds,
                  Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Annotated[bool, _only(False)] = False
    best_of: Annotated[int, _only(1)] | None = None
    suffix: None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        """Name the problem (the union's own error says "not a string" for any bad list)."""
        if isinstance(v, list) and len(v) > 1 and all(isinstance(x, (str, list)) for x in v):
            raise ValueError(f"one prompt per request is supported, got {len(v)}")
        one = v[0] if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)) else v
        if isinstance(one, list) and not all(type(t) is int for t in one):  # bool is an int subclass
            raise ValueError("token ids must be integers")
        if not isinstance(one, (str, list)):
            raise ValueError("must be a string, a list of token ids, or a one-element list of either")
        if not one:
            raise ValueError("must not be empty")
        return v

    def prompt_value(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            return p[0]
        return p


class TextPart(BaseModel):
    model_config = REQUEST_CONFIG
    type: Literal["text"]
    text: str


def _content_kind(v: Any) -> str | None:
    """Which member of ``ChatMessage.content`` a value is meant as (errors then name that one)."""
    return type(v).__name__ if isinstance(v, (str, list)) else None


class ChatMessage(BaseModel):
    model_config = REQUEST_CONFIG
    role: Literal["system", "user", "assistant", "developer"]
    content: Annotated[
        Union[Annotated[str, Tag("str")], Annotated[list[TextPart], Field(min_length=1), Tag("list")]],
        Discriminator(_content_kind, custom_error_type="invalid_content",
                      custom_error_message="must be a string or a list of text parts"),
    ]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --- responses ---------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvslim"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` passes as is)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"
