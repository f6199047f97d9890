"""The official ``openai`` client against a real ``compress serve`` process (tiny model)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.runtime.server.conftest import API_KEY

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_is_deterministic_and_counts_tokens(client):
    a = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens > 0 and a.usage.total_tokens == a.usage.prompt_tokens + 12


def test_streamed_completion_equals_the_non_streamed_one(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_completion_and_stream_agree(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt="Random words:", max_tokens=10, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_top_k_reaches_the_sampler(client):
    """top_k=1 samples the most likely token: the greedy text, whatever the temperature."""
    kw = dict(model=MODEL, prompt="Random words:", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    top1 = client.completions.create(temperature=1.5, seed=7, **{**kw, "extra_body": {"ignore_eos": True, "top_k": 1}})
    assert top1.choices[0].text == greedy
    for off in (-1, 0):
        client.completions.create(temperature=1.0, **{**kw, "extra_body": {"ignore_eos": True, "top_k": off}})


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL, prompt="Numbers:", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_logprobs_in_both_apis(client):
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - x) < 1e-4 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=2), "n"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(prompt=[1, -2, 99999999]), "prompt"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"max_tokens": "5"}), "max_tokens"),
])
def test_invalid_parameters_are_400_in_openai_shape(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **{"prompt": "x", "max_tokens": 4, **kwargs})
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["param"].startswith(param) and body["message"]


def test_prompt_beyond_max_model_len_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[11] * 300, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[11] * 200, max_tokens=100)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_api_key_guards_every_endpoint_but_health(server):
    base = server.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/openapi.json"), ("GET", "/docs")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, f"{base}{path}", headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_report_kv_footprint_and_latencies(server, client):
    client.completions.create(model=MODEL, prompt="Metrics", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    m = server.metrics()
    # fp32 KV of the tiny model: 4 layers x 2 (K, V) x 2 heads x 32 dims x 4 bytes; the original in bf16.
    assert m["kvslim_kv_bytes_per_token"] == 4 * 2 * 2 * 32 * 4
    assert m["kvslim_kv_bytes_per_token_original"] == 4 * 2 * 2 * 32 * 2
    assert m['kvslim_kv_cache_info{kv_dtype="fp32"}'] == 1
    assert m["kvslim_time_to_first_token_seconds_count"] >= 1
    assert m["kvslim_generation_tokens_total"] >= 4
    assert m["kvslim_prompt_tokens_total"] >= 1
    assert 'kvslim_kv_blocks_total{group="0"}' in m


def test_greedy_text_equals_the_engine_run_offline(client, tiny_chat_checkpoint):
    """The HTTP layer adds nothing: same tokens as ``Engine.generate`` in this process."""
    from transformers import AutoTokenizer

    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_chat_checkpoint)
    prompt = tok("In 1905, Einstein published", add_special_tokens=False)["input_ids"]
    engine = Engine.from_checkpoint(tiny_chat_checkpoint, EngineConfig(max_model_len=256, kv_cache_bytes=16 << 20))
    [offline] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert served.choices[0].text == tok.decode(offline.token_ids, skip_special_tokens=True)


def test_shared_system_prompt_is_served_from_the_prefix_cache(server, client):
    system = "You answer in one word. " + "Background: the quick brown fox jumps over the lazy dog. " * 8
    before = server.metrics()
    for question in ("Colour of the sky?", "Colour of grass?"):
        client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    m = server.metrics()
    hits = m["kvslim_prefix_cache_hits_total"] - before["kvslim_prefix_cache_hits_total"]
    assert hits >= 16 * 5  # the second request reuses the shared system prompt's full blocks
    assert 0 < m["kvslim_prefix_cache_hit_rate"] <= 1
