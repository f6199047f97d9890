"""Prometheus metrics of the server (prometheus-client, one registry per app).

Engine state (requests running / waiting, KV blocks and usage, prefix-cache hit rate) is read
from an ``EngineSnapshot`` at scrape time; latencies and token counts are recorded per request.
KV bytes per token come from the shared formula (``AttentionLayout.kv_bytes_per_token``) at
``max_model_len``, for the served model and for the original model it is compared with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from foundation.attention_layout import AttentionLayout
from runtime.server.engine_client import EngineSnapshot

if TYPE_CHECKING:
    from runtime.cache.kv_cache import KVCacheSpec

PREFIX = "kvslim"
ORIGINAL_KV_BYTES = 2  # the original model's KV cache is counted in bf16
# Latency buckets (seconds) in the manner of vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass(frozen=True)
class KVFootprint:
    """KV bytes per token of the served model and of the original it is compared with."""

    bytes_per_token: float
    original_bytes_per_token: float
    kv_dtype: str  # what the served cache stores: a dtype name, or FULL/WINDOWED (foundation.kv_dtype_mix)

    @property
    def saving(self) -> float:
        """Fraction of the original's KV bytes per token saved (0.75 = 4x smaller)."""
        return 1.0 - self.bytes_per_token / self.original_bytes_per_token

    @classmethod
    def of(cls, spec: "KVCacheSpec", layout: AttentionLayout, original: AttentionLayout, context_len: int,
           kv_dtype: str) -> "KVFootprint":
        """Served ``layout`` in ``spec``'s cache groups vs ``original`` in bf16, both at ``context_len`` tokens."""
        return cls(spec.kv_bytes_per_token(layout, context_len),
                   original.kv_bytes_per_token(context_len, ORIGINAL_KV_BYTES), kv_dtype)


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], footprint: KVFootprint):
        self.snapshot = snapshot
        self.footprint = footprint

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.snapshot()
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Requests in the running batch.", s.num_running)
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_percent", "KV cache blocks in use, percent of all blocks.",
                                100.0 * s.kv_usage)
        used = GaugeMetricFamily(f"{PREFIX}_kv_blocks_in_use", "KV blocks with a live reference, per cache group.",
                                 labels=["group"])
        total = GaugeMetricFamily(f"{PREFIX}_kv_blocks_total", "KV blocks allocated, per cache group.", labels=["group"])
        for g, (u, t) in enumerate(zip(s.blocks_in_use, s.blocks_total)):
            used.add_metric([str(g)], u)
            total.add_metric([str(g)], t)
        yield used
        yield total
        yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_hit_rate",
                                "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                                s.prefix_cache_hit_rate)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queried_tokens)
        yield CounterMetricFamily(f"{PREFIX}_prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                  s.prefix_cache_hit_tokens)
        yield GaugeMetricFamily(f"{PREFIX}_num_preemptions", "Requests preempted (recomputed) so far.", s.num_preemptions)
        fp = self.footprint
        yield GaugeMetricFamily(f"{PREFIX}_kv_bytes_per_token", "KV cache bytes per token of the served model.",
                                fp.bytes_per_token)
        yield GaugeMetricFamily(f"{PREFIX}_kv_bytes_per_token_original",
                                "KV cache bytes per token of the original model (bf16 KV).", fp.original_bytes_per_token)
        yield GaugeMetricFamily(f"{PREFIX}_kv_bytes_saving_ratio",
                                "1 - served / original KV bytes per token.", fp.saving)
        info = GaugeMetricFamily(f"{PREFIX}_kv_cache_info", "What the served KV cache stores (value 1).",
                                 labels=["kv_dtype"])
        info.add_metric([fp.kv_dtype], 1)
        yield info


class ServerMetrics:
    """Per-request histograms and counters plus the engine's gauges, in one registry."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], footprint: KVFootprint):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter(f"{PREFIX}_request_success", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "Requests refused before they reached the engine.",
                                ["reason"], registry=r)
        r.register(_EngineCollector(snapshot, footprint))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latency bookkeeping of one request: call ``tokens(n, t)`` as tokens arrive, then ``finish``."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0

    def tokens(self, n: int, t: float) -> None:
        if n <= 0:
            return
        if self.first is None:
            self.first = t
            self.m.ttft.observe(t - self.arrival)
        elif self.last is not None:
            # A step hands out one token per request; several at once share the gap.
            gap = (t - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = t
        self.num_tokens += n
        self.m.generation_tokens.inc(n)

    def finish(self, prompt_tokens: int, finish_reason: str, t: float) -> None:
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.requests.labels(finish_reason).inc()
        self.m.e2e.observe(t - self.arrival)
        if self.first is not None and self.num_tokens > 1:
            self.m.tpot.observe(((self.last or t) - self.first) / (self.num_tokens - 1))
