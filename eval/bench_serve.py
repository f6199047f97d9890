"""Serving load generator in the manner of vLLM's ``bench serve``: drive an OpenAI-compatible
server with streamed completions and report throughput and latency.

    compress bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 --request-rate 4 \\
        --input-len 128 --output-len 64 --json runs/serve.json

Requests arrive as a Poisson process (``--request-rate``; ``inf`` sends them all at once) and/or
under a concurrency cap (``--max-concurrency``). Prompts are windows of ``--input-len`` tokens cut
from real held-out text (``wikipedia:eval``), sent as token ids with ``ignore_eos`` so every
request produces ``--output-len`` tokens; or lines of a JSONL ``--dataset`` (``{"prompt": str,
"output_len": int?}``). TTFT is the time to the first streamed token, ITL the gaps between
streamed chunks, TPOT a request's (latency - TTFT) / (output tokens - 1).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import httpx

from foundation.errors import KvslimError

TEXT_RANGE = "wikipedia:eval"


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None  # known when the prompt is token ids


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class BenchSummary:
    base_url: str
    model: str
    prompts: str
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2el_ms: dict
    errors: list[str]
    server_kv: dict = field(default_factory=dict)  # the server's KV cache, from its /metrics when it says


def percentiles(values: Sequence[float]) -> dict:
    """Mean, median and p99 in milliseconds (NaN when there are no values)."""
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    xs = sorted(values)

    def q(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"mean": 1000 * sum(xs) / len(xs), "median": 1000 * q(0.5), "p99": 1000 * q(0.99)}


def text_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``num_prompts`` windows of ``input_len`` tokens at random offsets in ``wikipedia:eval``."""
    from foundation.texts import load_documents

    if input_len < 1 or output_len < 1:
        raise KvslimError("--input-len and --output-len must be positive")
    ids: list[int] = []
    for doc in load_documents(TEXT_RANGE):
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if len(ids) >= 64 * input_len + num_prompts:
            break
    if len(ids) < input_len:
        raise KvslimError(f"{TEXT_RANGE} has only {len(ids)} tokens, fewer than --input-len {input_len}")
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(ids) - input_len + 1) for _ in range(num_prompts)]
    return [BenchRequest(ids[s:s + input_len], output_len, input_len) for s in starts]


def dataset_requests(path: Path, num_prompts: int, default_output_len: int) -> list[BenchRequest]:
    """The first ``num_prompts`` lines of a JSONL file of ``{"prompt": str, "output_len": int?}``."""
    if not path.is_file():
        raise KvslimError(f"--dataset {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, olen = row["prompt"], int(row.get("output_len", default_output_len))
        except (ValueError, KeyError, TypeError) as e:
            raise KvslimError(f"--dataset {path}:{n}: expected {{\"prompt\": str, \"output_len\": int}} ({e})") from e
        if not isinstance(prompt, str) or not prompt or olen < 1:
            raise KvslimError(f"--dataset {path}:{n}: empty prompt or output_len < 1")
        out.append(BenchRequest(prompt, olen, None))
        if len(out) == num_prompts:
            break
    if len(out) < num_prompts:
        raise KvslimError(f"--dataset {path} has {len(out)} prompts, fewer than --num-prompts {num_prompts}")
    return out


async def send(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest) -> RequestResult:
    """One streamed completion; timings from the client's side."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens in the response"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, seed: int, api_key: str | None) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with Poisson arrivals at ``request_rate`` and at most ``max_concurrency``
    in flight; returns the results (in request order) and the wall time."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests), max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def one(req: BenchRequest) -> RequestResult:
            if gate is None:
                return await send(client, url, model, req)
            async with gate:
                return await send(client, url, model, req)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, *, base_url: str, model: str, prompts: str,
              request_rate: float, max_concurrency: int | None) -> BenchSummary:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return BenchSummary(
        base_url=base_url, model=model, prompts=prompts, num_prompts=len(results), request_rate=request_rate,
        max_concurrency=max_concurrency, completed=len(ok), failed=len(results) - len(ok),
        duration_s=duration, total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft_ms=percentiles([r.ttft for r in ok]), tpot_ms=percentiles(tpots),
        itl_ms=percentiles([x for r in ok for x in r.itl]), e2el_ms=percentiles([r.latency for r in ok]),
        errors=sorted({r.error for r in results if not r.ok})[:10],
    )


def format_summary(s: BenchSummary) -> str:
    rows = [
        ("Model / prompts", f"{s.model} / {s.prompts}"),
        ("Request rate / max concurrency", f"{s.request_rate} / {s.max_concurrency or '-'}"),
        ("Successful / failed requests", f"{s.completed} / {s.failed}"),
        ("Benchmark duration (s)", f"{s.duration_s:.2f}"),
        ("Total input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
    ]
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E latency", s.e2el_ms)):
        rows.append((f"{name} mean / median / p99 (ms)", f"{d['mean']:.1f} / {d['median']:.1f} / {d['p99']:.1f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.server_kv:
        kv = s.server_kv
        per_token = f", {kv['bytes_per_token']:g} B/token" if kv.get("bytes_per_token") is not None else ""
        lines.append(f"{'Server KV cache':<{width}}  {kv.get('kv_dtype', '?')}{per_token}")
    lines += [f"error: {e}" for e in s.errors]
    return "\n".join(lines)


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise KvslimError(f"cannot reach {base_url}: {e}") from e
    if r.status_code != 200:
        raise KvslimError(f"{base_url}/v1/models answered HTTP {r.status_code}")
    return r.json()["data"][0]["id"]


def server_kv_cache(base_url: str, api_key: str | None) -> dict:
    """The KV dtype (and bytes per token) a server reports in ``/metrics``: kvslim's
    ``kvslim_kv_cache_info`` / ``kvslim_kv_bytes_per_token`` or vLLM's ``cache_config_info``;
    empty when the server does not say."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
        families = list(text_string_to_metric_families(r.text)) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    kv: dict = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "kvslim_kv_cache_info":
                kv["kv_dtype"] = sample.labels.get("kv_dtype")
            elif sample.name == "kvslim_kv_bytes_per_token":
                kv["bytes_per_token"] = sample.value
            elif sample.name.endswith("cache_config_info") and "cache_dtype" in sample.labels:
                kv.setdefault("kv_dtype", sample.labels["cache_dtype"])
    return kv


def bench_serve(base_url: str, num_prompts: int, request_rate: float, max_concurrency: int | None,
                input_len: int | None, output_len: int, dataset: Path | None, tokenizer_source: str,
                seed: int = 0, api_key: str | None = None, model: str | None = None) -> BenchSummary:
    """Build the prompts, run the load, summarize."""
    if num_prompts < 1:
        raise KvslimError("--num-prompts must be at least 1")
    if not (request_rate > 0):
        raise KvslimError("--request-rate must be positive (inf for all at once)")
    if max_concurrency is not None and max_concurrency < 1:
        raise KvslimError("--max-concurrency must be at least 1")
    model = model or served_model(base_url, api_key)
    if dataset is not None:
        requests, prompts = dataset_requests(dataset, num_prompts, output_len), f"dataset {dataset.name}"
    else:
        from transformers import AutoTokenizer

        from foundation.model_source import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer_source))
        requests = text_requests(tokenizer, num_prompts, input_len, output_len, seed)
        prompts = f"{TEXT_RANGE} {input_len} tokens in, {output_len} out"
    results, duration = asyncio.run(run_load(base_url, model, requests, request_rate, max_concurrency, seed, api_key))
    summary = summarize(results, duration, base_url=base_url, model=model, prompts=prompts,
                        request_rate=request_rate, max_concurrency=max_concurrency)
    return replace(summary, server_kv=server_kv_cache(base_url, api_key))


def write_json(summary: BenchSummary, path: Path) -> None:
    from foundation.atomic import write_text_atomic

    write_text_atomic(path, json.dumps(asdict(summary), indent=2, allow_nan=True) + "\n")
