"""Request validation, in process (a fake engine behind the real app): every bad body is a 400
whose message names the problem and whose ``param`` is the request field, never a pydantic name."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from runtime.engine.engine import StepOutput
from runtime.engine.sampling import SamplingParams
from runtime.server.app import create_app
from runtime.server.engine_client import EngineSnapshot
from runtime.server.metrics import KVFootprint

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Hi"}]


class FakeEngine:
    """An ``EngineClient`` that answers every request with ``max_tokens`` copies of one token."""

    max_model_len = 64

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams):
        self.params.append(params)
        tokens = [11] * params.max_tokens
        yield StepOutput(0, prompt_token_ids, tokens, tokens, None, True, "length")

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(0, 0, (0,), (1,), 0, 0, 0)


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def client(tiny_chat_checkpoint, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_checkpoint)
    with TestClient(create_app(engine, tokenizer, MODEL, KVFootprint(1.0, 2.0, "fp32"))) as c:
        yield c


def _error(client: TestClient, path: str, body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    for leak in ("constrained", "function-", "[", "Value error"):
        assert leak not in (err["param"] or "") and leak not in err["message"], err
    return err


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2, 3]], "Hello", ["Hello"]])
def test_valid_prompts(client, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("prompt, message", [
    ([1, -2, 99999999], "token id -2 is out of range"),
    ([1, 2, 99999999], "token id 99999999 is out of range"),
    ([[5, 49152]], "token id 49152 is out of range"),
    ([], "must not be empty"),
    ([[]], "must not be empty"),
    ("", "must not be empty"),
    ([""], "must not be empty"),
    (["a", "b"], "one prompt per request"),
    ([1, 2.5], "token ids must be integers"),
    ([1, True], "token ids must be integers"),
    (5, "must be a string, a list of token ids"),
])
def test_bad_prompt_names_the_problem(client, prompt, message):
    err = _error(client, "/v1/completions", {"prompt": prompt})
    assert message in err["message"] and err["param"] == "prompt"


@pytest.mark.parametrize("stop, message", [
    ([""], "must not be empty"),
    ("", "must not be empty"),
    (["a", "b", "c", "d", "e"], "at most 4 stop strings"),
    (["x" * 300], "at most 256 characters"),
    ([1], "must be a string or a list of strings"),
])
def test_bad_stop_names_the_problem(client, stop, message):
    err = _error(client, "/v1/completions", {"prompt": "x", "stop": stop})
    assert message in err["message"] and err["param"] == "stop"


@pytest.mark.parametrize("raw, position", [(b'{"prompt": "x",, }', 15), (b"not json", 0)])
def test_malformed_json_names_the_position_not_a_param(client, raw, position):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith(f"invalid JSON body at character {position}: ") and err["param"] is None


def test_a_body_that_is_not_an_object(client):
    err = _error(client, "/v1/completions", [1, 2])
    assert err["message"] == "the request body must be a JSON object" and err["param"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]},
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
])
def test_param_is_the_request_field_path(client, path, body, param):
    assert _error(client, path, body)["param"] == param


@pytest.mark.parametrize("top_k, expected", [(-1, 0), (0, 0), (5, 5)])
def test_top_k_minus_one_and_zero_disable_it(client, engine, top_k, expected):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": top_k})
    assert r.status_code == 200, r.text
    assert engine.params[-1].top_k == expected


@pytest.mark.parametrize("field, value", [
    ("top_k", -5), ("top_k", "5"),
    ("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 2.0),
    ("stream", "yes"), ("stream", 1), ("ignore_eos", "true"),
    ("seed", "1"), ("logprobs", True), ("temperature", "1"), ("temperature", True),
    ("n", True), ("n", 1.0), ("n", 2), ("best_of", True), ("echo", 0), ("echo", True),
    ("presence_penalty", False), ("frequency_penalty", 0.5),
])
def test_types_are_strict(client, field, value):
    err = _error(client, "/v1/completions", {"prompt": "x", field: value})
    assert err["param"] == field


@pytest.mark.parametrize("field, value", [("logprobs", "yes"), ("max_completion_tokens", "3")])
def test_chat_types_are_strict(client, field, value):
    assert _error(client, "/v1/chat/completions", {"messages": CHAT, field: value})["param"] == field


def test_numbers_take_json_integers_and_unknown_fields_pass(client):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 1, "top_p": 1, "tools": [{"type": "function"}],
            "n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/completions", '{"prompt": "hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udbff"]}', "prompt.0"),
    ("/v1/completions", '{"prompt": "x", "stop": ["ok", "\\ud800"]}', "stop.1"),
    ("/v1/completions", '{"prompt": "x", "user": "\\ud800"}', "user"),
])
def test_lone_surrogates_are_a_400_naming_the_field(client, path, raw, param):
    r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"] and err["message"].startswith(param)


def test_a_lone_surrogate_in_a_field_name_is_a_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x", "\\ud800": 1}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "field name" in r.json()["error"]["message"]


@pytest.mark.parametrize("content", ["NUL \u0000 inside", "\U0001F600 emoji", "e\u0301 combining"])
def test_unusual_but_valid_text_is_served(client, content):
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 1}).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(client, monkeypatch):
    """FakeEngine's context is 64 tokens; no token of this tokenizer spans more than 162 bytes."""
    from runtime.server.prompt_encoder import PromptEncoder

    monkeypatch.setattr(PromptEncoder, "_tokenize", lambda *a: pytest.fail("tokenized a prompt that cannot fit"))
    err = _error(client, "/v1/completions", {"prompt": "x" * 20_000, "max_tokens": 1})
    assert "at least" in err["message"] and err["param"] == "prompt"
    err = _error(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 20_000}]})
    assert "at least" in err["message"] and err["param"] == "messages"


def test_a_body_over_the_limit_is_a_413(tiny_chat_checkpoint, engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_checkpoint)
    app = create_app(engine, tokenizer, MODEL, KVFootprint(1.0, 2.0, "fp32"), max_request_bytes=1000)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it is read
            for _ in range(4):
                yield b" " * 400
        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
