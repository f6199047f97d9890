"""Load, disconnects, admission and drain against real ``compress serve`` processes (tiny model).

Every loop is bounded in count and in time; everything talks to 127.0.0.1 only.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.runtime.server.conftest import ServerProcess, serve_argv

MODEL = "tiny"
LOAD_REQUESTS = 200
LOAD_CONCURRENCY = 32  # > max_num_seqs (8): requests wait in the engine's queue
DISCONNECTS = 20
IMPATIENT = 5  # non-streamed clients that time out
WALL_LIMIT_S = 90.0


async def _completion(client: httpx.AsyncClient, i: int) -> tuple[int, int]:
    """One request (odd: streamed, even: not); returns (status, completion tokens)."""
    body = {"model": MODEL, "max_tokens": 4 + i % 13, "temperature": 0 if i % 3 else 0.8, "seed": i,
            "ignore_eos": True}
    if i % 4 == 0:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Question {i}?"}]
    else:
        path, body["prompt"] = "/v1/completions", f"Request number {i} says" + " more" * (i % 20)
    if i % 2:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
        usage = None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return r.status_code, 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        return 200, usage["completion_tokens"] if usage else -1
    r = await client.post(path, json=body)
    return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0


def test_saturation_200_requests_no_errors_then_no_blocks_in_use(server):
    async def run():
        gate = asyncio.Semaphore(LOAD_CONCURRENCY)
        limits = httpx.Limits(max_connections=LOAD_CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, limits=limits,
                                     timeout=60) as client:
            async def one(i):
                async with gate:
                    return await _completion(client, i)

            async def watch(done: asyncio.Event) -> tuple[float, float]:
                """/metrics answers while the engine is busy; the most running / waiting seen."""
                most_running = most_waiting = 0.0
                while not done.is_set():
                    text = (await client.get("/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("kvslim_num_requests_running "):
                            most_running = max(most_running, float(line.split()[1]))
                        if line.startswith("kvslim_num_requests_waiting "):
                            most_waiting = max(most_waiting, float(line.split()[1]))
                    await asyncio.sleep(0.2)
                return most_running, most_waiting

            done = asyncio.Event()
            watcher = asyncio.create_task(watch(done))
            try:
                results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(LOAD_REQUESTS))),
                                                 WALL_LIMIT_S)
            finally:
                done.set()
            return results, await watcher

    before = server.metrics()
    results, (most_running, most_waiting) = asyncio.run(run())
    assert most_running == 8 and most_waiting > 0  # saturated: a full batch and a queue behind it
    assert [s for s, _ in results] == [200] * LOAD_REQUESTS
    assert [n for _, n in results] == [4 + i % 13 for i in range(LOAD_REQUESTS)]
    m = server.wait_idle()
    assert m['kvslim_kv_blocks_in_use{group="0"}'] == 0
    assert m["kvslim_num_requests_running"] == 0 and m["kvslim_num_requests_waiting"] == 0
    done = sum(v for k, v in m.items() if k.startswith("kvslim_request_success_total"))
    done_before = sum(v for k, v in before.items() if k.startswith("kvslim_request_success_total"))
    assert done - done_before == LOAD_REQUESTS
    assert m["kvslim_generation_tokens_total"] - before.get("kvslim_generation_tokens_total", 0) == sum(
        4 + i % 13 for i in range(LOAD_REQUESTS))


def test_clients_disconnecting_mid_stream_free_their_blocks(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Long story {i}:", "max_tokens": 200, "ignore_eos": True,
                        "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {")
                        if seen >= 2:
                            return seen  # leaving the block closes the connection mid-stream

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(DISCONNECTS))), WALL_LIMIT_S)

    async def impatient():
        """Non-streamed requests whose clients give up: the server notices between steps."""
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=0.5) as client:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Patience {i}", "max_tokens": 200, "ignore_eos": True}
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", json=body)

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(IMPATIENT))), WALL_LIMIT_S)

    before = server.metrics()
    assert asyncio.run(run()) == [2] * DISCONNECTS
    asyncio.run(impatient())
    m = server.wait_idle()
    assert m['kvslim_kv_blocks_in_use{group="0"}'] == 0
    assert m["kvslim_num_requests_running"] == 0 and m["kvslim_num_requests_waiting"] == 0
    aborted = m.get('kvslim_request_success_total{finish_reason="abort"}', 0)
    assert aborted - before.get('kvslim_request_success_total{finish_reason="abort"}', 0) == DISCONNECTS + IMPATIENT
    # Far fewer tokens than 200 per request were generated: the requests really stopped.
    generated = m["kvslim_generation_tokens_total"] - before["kvslim_generation_tokens_total"]
    assert generated < (DISCONNECTS + IMPATIENT) * 200 / 2


@pytest.fixture
def small_server(tiny_chat_checkpoint, tmp_path):
    srv = ServerProcess(serve_argv(tiny_chat_checkpoint, "--max-num-seqs", "1", "--max-queue", "2",
                                   "--max-model-len", "256", "--kv-cache-mib", "4", "--served-model-name", MODEL),
                        tmp_path / "small.log")
    yield srv
    srv.kill()


def test_full_queue_is_429_and_sigterm_drains_in_flight_requests(small_server):
    srv = small_server
    assert "Authorization" not in srv.headers  # no key: open API

    async def run():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            long = {"model": MODEL, "prompt": "Drain me", "max_tokens": 60, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=long) as r1, \
                    client.stream("POST", "/v1/completions", json=long) as r2:
                assert r1.status_code == r2.status_code == 200
                lines1, lines2 = r1.aiter_lines(), r2.aiter_lines()
                await anext(lines1), await anext(lines2)
                third = await client.post("/v1/completions", json={**long, "stream": False})
                assert third.status_code == 429
                err = third.json()["error"]
                assert err["code"] == "queue_full" and err["type"] and err["message"]
                # SIGTERM while two requests are in flight: both still finish.
                srv.proc.send_signal(15)
                texts = []
                for lines in (lines1, lines2):
                    finish, done = None, False
                    async for line in lines:
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {"):
                            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                    texts.append((finish, done))
                return texts

    assert asyncio.run(asyncio.wait_for(run(), WALL_LIMIT_S)) == [("length", True)] * 2
    deadline = time.monotonic() + 30
    while srv.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.proc.returncode == 0  # a drained SIGTERM is a clean exit
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.base_url}/health", timeout=2)
