"""What a hostile but fair client cannot do to a real ``compress serve`` (tiny model): stall the
others by sending a huge prompt, hold connections by never finishing a request, open connections
without bound. Everything talks to 127.0.0.1 only; every wait is bounded."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.runtime.server.conftest import HOST, REPO, ServerProcess, free_port, serve_argv
from tests.tiny_models import make_tiny_checkpoint

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 24


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory, default_model_dir):
    """The tiny model with a context long enough that a 4 MB prompt is tokenized, not refused first."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long") / "tiny-long", "llama", vocab_size=49152,
                                tokenizer_from=default_model_dir, max_position_embeddings=1 << 16)


@pytest.fixture(scope="module")
def guarded_server(long_context_checkpoint, tmp_path_factory):
    srv = ServerProcess(serve_argv(long_context_checkpoint, "--max-model-len", str(1 << 16), "--kv-cache-mib", "160",
                                   "--request-read-timeout", str(READ_TIMEOUT_S),
                                   "--max-connections", str(MAX_CONNECTIONS)),
                        tmp_path_factory.mktemp("log") / "guarded.log")
    yield srv
    srv.stop()


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass  # a 503 / 408 body may come first
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _open(srv: ServerProcess, first_bytes: bytes) -> socket.socket:
    sock = socket.create_connection((HOST, srv.port), timeout=5)
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


@pytest.mark.parametrize("first_bytes", [
    b"",  # connected, silent
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",  # headers never finished
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    b'{"prompt":',  # 10 of 1,000 announced body bytes
], ids=["silent", "headers", "body"])
def test_stalled_connections_are_closed_within_the_read_timeout(guarded_server, first_bytes):
    socks = [_open(guarded_server, first_bytes) for _ in range(8)]
    r = httpx.post(f"{guarded_server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text  # normal traffic flows meanwhile
    t0 = time.monotonic()
    assert all(_closed_by_server(s, READ_TIMEOUT_S + 3) for s in socks)
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 3
    for s in socks:
        s.close()


def test_a_request_read_in_time_is_not_cut_by_the_deadline(guarded_server):
    """The deadline covers reading the request, not generating: a long answer outlives it."""
    r = httpx.post(f"{guarded_server.base_url}/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_connections_past_the_cap_are_refused_with_503(guarded_server):
    socks = [_open(guarded_server, b"") for _ in range(MAX_CONNECTIONS)]
    try:
        extra = _open(guarded_server, b"")
        extra.settimeout(5)
        assert extra.recv(64).startswith(b"HTTP/1.1 503")
        extra.close()
    finally:
        for s in socks:
            s.close()
    time.sleep(0.3)  # the server sees them go
    assert httpx.get(f"{guarded_server.base_url}/health", timeout=5).status_code == 200


def test_health_answers_while_a_huge_prompt_is_tokenized(guarded_server):
    """A prompt just under the 4 MiB body limit takes seconds to tokenize; /health must not wait."""
    words = "The quick brown fox jumps over the lazy dog. "
    prompt = words * ((4 << 20) // len(words) - 100)
    result = {}

    def send() -> None:
        r = httpx.post(f"{guarded_server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                       timeout=120)
        result["status"], result["message"] = r.status_code, r.json()["error"]["message"]

    worker = threading.Thread(target=send)
    worker.start()
    worst = 0.0
    with httpx.Client(timeout=10) as client:
        while worker.is_alive():
            t0 = time.perf_counter()
            assert client.get(f"{guarded_server.base_url}/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.02)
    worker.join()
    assert result["status"] == 400 and "maximum context length" in result["message"], result
    assert worst < 1.0, f"/health took {worst:.2f} s while a prompt was tokenized"


def test_a_body_past_the_limit_is_413_before_it_is_read(guarded_server):
    sock = _open(guarded_server, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                 b"content-length: 99999999\r\n\r\n")
    sock.settimeout(5)
    assert sock.recv(64).startswith(b"HTTP/1.1 413")
    sock.close()


def test_a_small_kv_budget_names_the_fix(long_context_checkpoint):
    done = subprocess.run([sys.executable, *serve_argv(long_context_checkpoint, "--kv-cache-mib", "1",
                                                       "--max-model-len", str(1 << 16), "--port", str(free_port()))],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "pass --max-model-len 512 or less, or --kv-cache-mib 128 or more" in err
