"""Prometheus metrics of one server app, in a registry of its own."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lmdeploy.serve.async_engine import AsyncEngine

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class Metrics:
    """Gauges read the engine loop's latest snapshot at scrape time; counters and histograms are fed by the request handlers.

    ``num_waiting`` gives the requests queued by the server's admission control.
    """

    def __init__(self, engine: AsyncEngine, num_waiting: Callable[[], int]):
        self.registry = registry = CollectorRegistry()
        self.engine = engine
        Gauge('lmdeploy:num_requests_running', 'Requests running in the engine.',
              registry=registry).set_function(lambda: engine.inst_manager.num_busy)
        Gauge('lmdeploy:num_requests_waiting', 'Requests waiting for admission.',
              registry=registry).set_function(lambda: num_waiting() + engine.inst_manager.num_waiting)
        Gauge('lmdeploy:kv_cache_usage_perc', 'KV-cache blocks in use, 0..1 (evictable prefix-cache blocks count '
              'as free).', registry=registry).set_function(self.kv_cache_usage)
        Gauge('lmdeploy:prefix_cache_hit_rate', 'Prefix-cache hits per queried full block, 0..1.',
              registry=registry).set_function(self.prefix_cache_hit_rate)
        Gauge('lmdeploy:grammar_cache_entries', 'Compiled grammars (response formats, forced tool calls) kept for '
              'reuse.', registry=registry).set_function(lambda: engine.grammar_cache_size()[0])
        Gauge('lmdeploy:grammar_cache_bytes', 'Bytes of the compiled grammars kept for reuse.',
              registry=registry).set_function(lambda: engine.grammar_cache_size()[1])
        self.ttft = Histogram('lmdeploy:time_to_first_token_seconds', 'Time to first token.',
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram('lmdeploy:time_per_output_token_seconds', 'Mean time per output token after the '
                              'first, per request.', buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram('lmdeploy:e2e_request_latency_seconds', 'End-to-end request latency.',
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.success = Counter('lmdeploy:request_success_total', 'Finished requests by finish reason.',
                               ['finish_reason'], registry=registry)
        self.prompt_tokens = Counter('lmdeploy:prompt_tokens_total', 'Prompt tokens processed.', registry=registry)
        self.generation_tokens = Counter('lmdeploy:generation_tokens_total', 'Tokens generated.',
                                         registry=registry)

    def kv_cache_usage(self) -> float:
        snapshot = self.engine.engine_loop.snapshot
        return 1.0 - snapshot.num_free_blocks / snapshot.num_blocks if snapshot.num_blocks else 0.0

    def prefix_cache_hit_rate(self) -> float:
        snapshot = self.engine.engine_loop.snapshot
        return snapshot.prefix_hits / snapshot.prefix_queries if snapshot.prefix_queries else 0.0

    def observe(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int, start: float,
                first_token: float | None, end: float) -> None:
        """Records one finished engine request (times from ``time.perf_counter``)."""
        self.success.labels(finish_reason=finish_reason or 'abort').inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.e2e.observe(end - start)
        if first_token is not None:
            self.ttft.observe(first_token - start)
            if output_tokens > 1:
                self.tpot.observe((end - first_token) / (output_tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
