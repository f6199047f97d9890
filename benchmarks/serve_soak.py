"""Soak `compress serve` as a hostile but fair client would, in one go (``make soak``).

Starts the server on the default model with a small KV pool (``SERVER_ARGS``), then runs:
(a) 500 mixed requests (completions and chat, streamed or not, greedy or sampled) at 64 in flight;
(b) 50 clients that hang up after 1-3 chunks, then a burst of 32 that must all finish;
(c) a fuzz pass over every field of both endpoints (wrong types, ranges, unicode with NUL and lone
    surrogates, huge values, token ids out of range, a prompt just under the body limit, a body
    over it) plus cases drawn from the server's own OpenAPI schema;
(d) 200 stalled connections (silent, unfinished headers, 10 of 1,000 body bytes) while normal
    traffic flows;
(e) 16 long requests on a pool too small for them at once (preemption);
(f) one greedy request alone, then again 8 times under load: the same text each time.
A poller times ``/health`` every 50 ms throughout. Per part: sent, ok, 4xx by code, 5xx, lost or
truncated, the slowest ``/health``, and KV blocks / requests still held once idle. Exit 1 on any
5xx, lost or truncated request, leaked block, wrong greedy text, stalled connection left open past
the read timeout, or ``/health`` slower than 1 s.

    python benchmarks/serve_soak.py --json benchmarks/results/serve_soak.json
    python benchmarks/serve_soak.py --device cuda       # the same soak on a GPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
API_KEY = "soak-key"
READ_TIMEOUT_S = 5.0
HEALTH_LIMIT_S = 1.0
BODY_LIMIT = 4 << 20
SERVER_ARGS = ["--kv-cache-mib", "48", "--max-model-len", "1024", "--max-num-seqs", "8", "--max-queue", "64",
               "--api-key", API_KEY, "--request-read-timeout", str(READ_TIMEOUT_S), "--log-level", "warning"]


@dataclass
class Part:
    """One part's counts."""

    name: str
    sent: int = 0
    ok: int = 0
    client_errors: Counter = field(default_factory=Counter)
    server_errors: int = 0
    lost: int = 0  # no answer, a broken stream, or fewer tokens than asked without a stop
    notes: list[str] = field(default_factory=list)  # failures
    health_max_s: float = 0.0
    blocks_in_use: float = 0.0
    requests_held: float = 0.0

    def record(self, status: int | None, complete: bool = True) -> None:
        self.sent += 1
        if status is None or (status == 200 and not complete):
            self.lost += 1
        elif status >= 500:
            self.server_errors += 1
        elif status >= 400:
            self.client_errors[status] += 1
        else:
            self.ok += 1

    @property
    def failed(self) -> bool:
        return bool(self.server_errors or self.lost or self.blocks_in_use or self.requests_held
                    or self.health_max_s > HEALTH_LIMIT_S or self.notes)


class Server:
    def __init__(self, model: str, device: str, dtype: str, log: Path):
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "cli.main", "serve", model, "--host", HOST, "--port", str(self.port),
                "--device", device, "--dtype", dtype, *SERVER_ARGS]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_soak: the server exited with {self.proc.returncode}: "
                                 f"{log.read_text()[-500:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise SystemExit("serve_soak: the server did not start in 300 s")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class Soak:
    def __init__(self, server: Server, seed: int, exact: bool):
        """``exact``: fp32 activations, where a greedy answer must not depend on its batch (in bf16
        a batched GEMM rounds differently and a near-tie may flip: counted, not failed)."""
        self.server = server
        self.exact = exact
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.rng = random.Random(seed)
        self.health_worst = 0.0

    def client(self, concurrency: int = 64, timeout: float = 300) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, headers=self.headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency + 8))

    async def poll_health(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.server.url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    await c.get("/health")
                except httpx.HTTPError:
                    pass
                self.health_worst = max(self.health_worst, time.perf_counter() - t0)
                await asyncio.sleep(0.05)

    async def idle_state(self, c: httpx.AsyncClient) -> tuple[float, float]:
        """(KV blocks in use, requests running + waiting) once the server has settled (<= 30 s)."""
        blocks = held = 0.0
        for _ in range(300):
            text = (await c.get("/metrics")).text
            blocks = sum(float(v) for v in re.findall(r'^kvslim_kv_blocks_in_use\{[^}]*\} (\S+)$', text, re.M))
            held = sum(float(v) for v in re.findall(r'^kvslim_num_requests_(?:running|waiting) (\S+)$', text, re.M))
            if blocks == 0 and held == 0:
                break
            await asyncio.sleep(0.1)
        return blocks, held

    async def request(self, c: httpx.AsyncClient, path: str, body: dict, stream: bool,
                      hang_up_after: int | None = None) -> tuple[int | None, dict]:
        """(status, result): result holds text, completion tokens, finish reason and whether a
        stream ended with [DONE]."""
        try:
            if not stream:
                r = await c.post(path, json=body)
                data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if r.status_code != 200:
                    return r.status_code, data
                choice = data["choices"][0]
                text = choice.get("text") if "text" in choice else choice["message"]["content"]
                return 200, {"text": text, "tokens": data["usage"]["completion_tokens"],
                             "finish": choice["finish_reason"], "done": True}
            out = {"text": "", "tokens": None, "finish": None, "done": False}
            async with c.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, {}
                chunks = 0
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return 500, event
                        chunks += 1
                        for ch in event.get("choices", []):
                            out["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                            out["finish"] = ch.get("finish_reason") or out["finish"]
                        if event.get("usage"):
                            out["tokens"] = event["usage"]["completion_tokens"]
                        if hang_up_after is not None and chunks >= hang_up_after:
                            return 200, {**out, "hung_up": True}
            return 200, out
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            return None, {"error": f"{type(e).__name__}: {e}"}

    def mixed_body(self, i: int) -> tuple[str, dict, bool]:
        stream = i % 2 == 1
        body = {"max_tokens": 1 + self.rng.randrange(32), "ignore_eos": True,
                "temperature": 0 if i % 3 else 0.8, "seed": i}
        if i % 4 == 0:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Tell me about {i}."}]
        else:
            path, body["prompt"] = "/v1/completions", f"Request {i}:" + " again" * self.rng.randrange(200)
        if stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
        return path, body, stream

    async def complete(self, part: Part, c: httpx.AsyncClient, path: str, body: dict, stream: bool) -> dict:
        status, out = await self.request(c, path, body, stream)
        complete = status == 200 and out.get("done") and (
            out.get("tokens") == body["max_tokens"] or out.get("finish") == "stop")
        part.record(status, bool(complete))
        return out

    async def run_part(self, name: str, body) -> Part:
        part = Part(name)
        self.health_worst = 0.0
        stop = asyncio.Event()
        poller = asyncio.create_task(self.poll_health(stop))
        try:
            async with self.client() as c:
                await body(part, c)
                part.blocks_in_use, part.requests_held = await self.idle_state(c)
        finally:
            stop.set()
            await poller
        part.health_max_s = self.health_worst
        return part

    # --- the parts -----------------------------------------------------------------------------
    async def mixed(self, part: Part, c: httpx.AsyncClient, n: int = 500, in_flight: int = 64) -> None:
        gate = asyncio.Semaphore(in_flight)

        async def one(i: int) -> None:
            async with gate:
                await self.complete(part, c, *self.mixed_body(i))

        await asyncio.gather(*(one(i) for i in range(n)))

    async def disconnects(self, part: Part, c: httpx.AsyncClient) -> None:
        async def leave(i: int) -> None:
            body = {"prompt": f"A long story {i}:", "max_tokens": 300, "ignore_eos": True, "stream": True}
            status, out = await self.request(c, "/v1/completions", body, True, hang_up_after=1 + i % 3)
            part.record(status, bool(out.get("hung_up")))

        await asyncio.gather(*(leave(i) for i in range(50)))
        await asyncio.gather(*(self.complete(part, c, *self.mixed_body(i)) for i in range(1000, 1032)))

    def fuzz_bodies(self, spec: dict) -> list[tuple[str, dict | bytes]]:
        odd = [None, True, -1, 0, 2**63, -2**63, 1e308, float("nan"), "", "x", "\u0000", "a\ud800b", "\U0001F600",
               [], {}, [None], ["\udfff"], {"a": 1}, "9" * 10_000, [[1, 2]], list(range(5000)), [-1], [10**9]]
        base = {"/v1/completions": {"prompt": "Hi", "max_tokens": 4},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
        cases: list[tuple[str, dict | bytes]] = []
        for path, ok in base.items():
            schema_ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            props = spec["components"]["schemas"][schema_ref.rsplit("/", 1)[-1]]["properties"]
            for name in props:
                for value in odd:
                    cases.append((path, {**ok, name: value}))
            for value in odd:  # inside a message, a text part, a token-id prompt
                if path.endswith("chat/completions"):
                    cases.append((path, {**ok, "messages": [{"role": "user", "content": value}]}))
                    parts = [{"type": "text", "text": value}]
                    cases.append((path, {**ok, "messages": [{"role": "user", "content": parts}]}))
                    cases.append((path, {**ok, "messages": [{"role": value, "content": "x"}]}))
                else:
                    cases.append((path, {**ok, "prompt": [value] if not isinstance(value, list) else value}))
            for raw in (b"", b"{", b"[]", b"null", b'{"prompt": "\xff\xfe"}', b"\x00" * 64, b'{"a":' * 5000):
                cases.append((path, raw))
            huge = "The quick brown fox jumps over the lazy dog. " * ((BODY_LIMIT - 1024) // 45)
            cases.append((path, {**ok, "prompt": huge} if "prompt" in ok else
                          {**ok, "messages": [{"role": "user", "content": huge}]}))
            cases.append((path, {**ok, "prompt": huge + huge} if "prompt" in ok else
                          {**ok, "messages": [{"role": "user", "content": huge + huge}]}))
        self.rng.shuffle(cases)
        return cases

    async def fuzz(self, part: Part, c: httpx.AsyncClient) -> None:
        spec = (await c.get("/openapi.json")).json()
        gate = asyncio.Semaphore(16)

        async def one(path: str, body: dict | bytes) -> None:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with gate:
                try:
                    r = await c.post(path, content=content, headers={"content-type": "application/json"})
                    part.record(r.status_code)
                    if r.status_code >= 400 and "error" not in r.json():
                        part.notes.append(f"{r.status_code} without an error body")
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    if len(content) > BODY_LIMIT and isinstance(e, (httpx.ReadError, httpx.WriteError,
                                                                      httpx.RemoteProtocolError)):
                        part.record(413)  # refused before it was read: the client may see the close first
                        return
                    part.record(None)
                    part.notes.append(f"{type(e).__name__} for {str(body)[:80]}")

        await asyncio.gather(*(one(p, b) for p, b in self.fuzz_bodies(spec)))

    async def stalled(self, part: Part, c: httpx.AsyncClient) -> None:
        starts = [b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
                  b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n" + b'{"prompt":']
        writers = []
        for i in range(200):
            reader, writer = await asyncio.open_connection(HOST, self.server.port)
            if starts[i % 3]:
                writer.write(starts[i % 3])
                await writer.drain()
            writers.append((reader, writer))
        opened = time.monotonic()

        async def closed(reader: asyncio.StreamReader) -> float:
            """Seconds from opening until the server closed it (inf: still open past the limit)."""
            try:
                while await asyncio.wait_for(reader.read(4096), READ_TIMEOUT_S + 5):
                    pass
            except (asyncio.TimeoutError, ConnectionError):
                return float("inf")
            return time.monotonic() - opened

        watchers = asyncio.gather(*(closed(r) for r, _ in writers))
        await asyncio.gather(*(self.complete(part, c, *self.mixed_body(i)) for i in range(2000, 2032)))
        after = await watchers
        for _, w in writers:
            w.close()
        still_open = sum(t > READ_TIMEOUT_S + 2 for t in after)
        if still_open:
            part.notes.append(f"{still_open} of 200 stalled connections open past {READ_TIMEOUT_S + 2:.0f} s")
        part.stalled_closed_max_s = max((t for t in after if t != float("inf")), default=None)

    async def long_requests(self, part: Part, c: httpx.AsyncClient) -> None:
        before = await self.preemptions(c)
        bodies = [("/v1/completions", {"prompt": f"Chapter {i}." + " It went on." * 100, "max_tokens": 400,
                                       "ignore_eos": True, "stream": i % 2 == 1}, i % 2 == 1) for i in range(16)]
        for _, b, s in bodies:
            if s:
                b["stream_options"] = {"include_usage": True}
        await asyncio.gather(*(self.complete(part, c, *b) for b in bodies))
        part.preemptions = await self.preemptions(c) - before

    async def preemptions(self, c: httpx.AsyncClient) -> float:
        m = re.search(r"^kvslim_num_preemptions (\S+)$", (await c.get("/metrics")).text, re.M)
        return float(m.group(1)) if m else 0.0

    async def greedy_repeat(self, part: Part, c: httpx.AsyncClient) -> None:
        body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
        alone = await self.complete(part, c, "/v1/completions", body, False)
        load = asyncio.gather(*(self.complete(part, c, *self.mixed_body(i)) for i in range(3000, 3048)))
        again = await asyncio.gather(*(self.complete(part, c, "/v1/completions", body, False) for _ in range(8)))
        await load
        same = sum(a.get("text") == alone.get("text") for a in again)
        part.greedy_same = f"{same} of 8"
        if same < 8 and self.exact:
            part.notes.append(f"{8 - same} of 8 greedy answers under load differ from the one alone")


def _also(p: Part) -> str:
    """What a part measures beyond the counts."""
    extra = {"preemptions": "{:.0f} preemptions", "stalled_closed_max_s": "last stalled closed at {:.1f} s",
             "greedy_same": "greedy under load = alone: {}"}
    return "; ".join(fmt.format(getattr(p, k)) for k, fmt in extra.items() if getattr(p, k, None) is not None) or "-"


def table(parts: list[Part]) -> str:
    head = ("part", "sent", "ok", "4xx", "5xx", "lost", "max /health ms", "blocks held", "reqs held", "also", "ok?")
    rows = [head]
    for p in parts:
        fourxx = " ".join(f"{k}:{v}" for k, v in sorted(p.client_errors.items())) or "0"
        rows.append((p.name, str(p.sent), str(p.ok), fourxx, str(p.server_errors), str(p.lost),
                     f"{p.health_max_s * 1000:.0f}", f"{p.blocks_in_use:.0f}", f"{p.requests_held:.0f}",
                     _also(p), "FAIL" if p.failed else "ok"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


async def soak(server: Server, seed: int, exact: bool) -> list[Part]:
    s = Soak(server, seed, exact)
    parts = []
    for name, body in [("a: 500 mixed at 64 in flight", s.mixed), ("b: 50 disconnects + 32 after", s.disconnects),
                       ("c: fuzz both endpoints", s.fuzz), ("d: 200 stalled connections", s.stalled),
                       ("e: 16 long through preemption", s.long_requests),
                       ("f: greedy alone vs under load", s.greedy_repeat)]:
        t0 = time.perf_counter()
        part = await s.run_part(name, body)
        part.wall_s = time.perf_counter() - t0
        print(f"{name}: {part.sent} sent in {part.wall_s:.0f} s{' ' + '; '.join(part.notes) if part.notes else ''}",
              flush=True)
        parts.append(part)
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="the server's activations (float32: greedy answers must not "
                                                      "depend on the batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "serve_soak_server.log"
    server = Server(args.model, args.device, args.dtype, log)
    try:
        parts = asyncio.run(soak(server, args.seed, exact=args.dtype == "float32"))
    finally:
        exit_code = server.stop()
    print(table(parts))
    failed = [p.name for p in parts if p.failed]
    print(f"server: {' '.join(SERVER_ARGS)}; exit after SIGTERM {exit_code}; "
          f"{'FAILED: ' + ', '.join(failed) if failed else 'every part passed'}")
    if args.json:
        sys.path.insert(0, str(REPO))
        from foundation.atomic import write_text_atomic

        doc = {"model": args.model, "device": args.device, "dtype": args.dtype, "server_args": SERVER_ARGS,
               "sigterm_exit": exit_code,
               "parts": [{**{k: v for k, v in vars(p).items() if k != "client_errors"},
                          "client_errors": dict(p.client_errors)} for p in parts]}
        write_text_atomic(args.json, json.dumps(doc, indent=2))
    return 1 if failed or exit_code != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
