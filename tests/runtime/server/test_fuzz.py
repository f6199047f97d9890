"""Fuzz the served OpenAPI schema with hypothesis: no input may produce a 5xx.

Bodies are drawn from the server's own ``/openapi.json`` (each request schema walked into a
strategy: valid values, boundary values, and wrong types), plus raw bytes and odd paths. The
number of examples and every request's time are bounded.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = 40
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Keep generations short: a valid max_tokens is usually small (the server itself caps nothing here).
SMALL_COUNTS = st.one_of(st.integers(-2, 6), st.just(10**12), st.integers())


def _resolve(schema: dict, spec: dict) -> dict:
    while "$ref" in schema:
        node = spec
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict, spec: dict, name: str = "", depth: int = 0) -> st.SearchStrategy:
    """A strategy for values of a JSON schema, with some invalid ones mixed in."""
    schema = _resolve(schema, spec)
    wrong = ANY_JSON if depth < 3 else st.none()
    if name in ("max_tokens", "max_completion_tokens"):
        return SMALL_COUNTS | st.none()
    if "const" in schema:
        return st.just(schema["const"]) | wrong
    if "enum" in schema:
        return st.sampled_from(schema["enum"]) | wrong
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, spec, name, depth + 1) for s in schema[key]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        fixed = {k: from_schema(v, spec, k, depth + 1) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, spec, k, depth + 1) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(fixed, optional=optional) | (wrong if depth else st.nothing())
    if kind == "array":
        item = from_schema(schema.get("items", {}), spec, name, depth + 1)
        return st.lists(item, max_size=min(schema.get("maxItems", 5) + 1, 6)) | wrong
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 40) + 2) | wrong
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        near = [v for b in (lo, hi) if b is not None for v in (b - 1, b, b + 1)]
        return st.integers(-3, 60) | st.sampled_from(near or [0]) | st.integers() | wrong
    if kind == "number":
        return st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, 0.0, 1.0, 2.0, 2.01]) | wrong
    if kind == "boolean":
        return st.booleans() | wrong
    if kind == "null":
        return st.none()
    return ANY_JSON


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    r = httpx.get(f"{server.base_url}/openapi.json", headers=server.headers, timeout=10)
    assert r.status_code == 200
    return r.json()


def _request_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _send(server, path: str, body) -> int:
    # json.dumps writes NaN / Infinity as the bare tokens Python's json.loads accepts: a client can
    # send them, so they are fuzz input too (httpx's own json= encoding refuses them).
    content = json.dumps(body, allow_nan=True)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        r = c.post(path, content=content, headers={"content-type": "application/json"})
        return r.status_code


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schema_fuzz_never_5xx(server, openapi, path):
    strategy = from_schema(_request_schema(openapi, path), openapi) | ANY_JSON

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=strategy)
    def check(body):
        status = _send(server, path, body)
        assert status < 500, (body, status)

    check()
    assert server.wait_idle()['kvslim_kv_blocks_in_use{group="0"}'] == 0


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                                                          "/metrics", "/health", "/v1/../etc/passwd", "/%2e%2e/x"]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data"]))
def test_raw_requests_never_5xx(server, raw, path, method, content_type):
    headers = {**server.headers, "Content-Type": content_type}
    r = httpx.request(method, f"{server.base_url}{path}", content=raw, headers=headers, timeout=30)
    assert r.status_code < 500
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
