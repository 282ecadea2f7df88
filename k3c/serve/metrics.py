"""The Prometheus metrics of one server (its own registry: two servers in one process do not mix).

Requests by endpoint and outcome; prompt, cached-prompt and generated tokens; histograms of time to first token,
inter-token latency, request latency and the batch each engine step ran; gauges of the running and waiting
requests, the MLA page pool, the prefix cache (checkpoints and bytes per tier) and its hit rate, and with
speculative decoding the draft tokens verified and kept. The engine loop
updates them after every step; /metrics renders them as Prometheus text.

vLLM's names, for dashboards built on them (same semantics; docs/runtime.md has the table):
    vllm:num_requests_running / waiting       k3c_requests_running / k3c_requests_waiting
    vllm:kv_cache_usage_perc                  k3c_kv_cache_usage (a fraction, as vLLM's)
    vllm:prefix_cache_queries / hits          k3c_prompt_tokens_total / k3c_prompt_tokens_cached_total (tokens)
    vllm:prompt_tokens / generation_tokens    k3c_prompt_tokens_total / k3c_generated_tokens_total
    vllm:request_success{finished_reason}     k3c_choices_finished_total{reason}
    vllm:time_to_first_token_seconds          k3c_time_to_first_token_seconds
    vllm:inter_token_latency_seconds          k3c_inter_token_latency_seconds
    vllm:e2e_request_latency_seconds          k3c_request_latency_seconds
    vllm:request_queue_time_seconds           k3c_request_queue_time_seconds
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("k3c_requests", "HTTP requests by endpoint and status code",
                                ("endpoint", "status"), registry=r)
        self.finished = Counter("k3c_choices_finished", "generated choices by how they ended",
                                ("reason",), registry=r)
        self.prompt_tokens = Counter("k3c_prompt_tokens", "prompt tokens of admitted choices", registry=r)
        self.cached_tokens = Counter("k3c_prompt_tokens_cached", "prompt tokens resumed from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("k3c_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("k3c_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("k3c_inter_token_latency_seconds", "time between two tokens of one choice",
                             buckets=_ITL, registry=r)
        self.latency = Histogram("k3c_request_latency_seconds", "request arrival to its last token",
                                 buckets=_LATENCY, registry=r)
        self.batch = Histogram("k3c_step_batch_size", "sequences that got a token in one engine step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.queue_time = Histogram("k3c_request_queue_time_seconds", "request arrival to joining the batch",
                                    buckets=_LATENCY, registry=r)
        self.running = Gauge("k3c_requests_running", "sequences in the engine's batch", registry=r)
        self.waiting = Gauge("k3c_requests_waiting", "sequences queued for a place in the batch", registry=r)
        self.pages_total = Gauge("k3c_kv_pages_total", "MLA page pool size (pages)", registry=r)
        self.pages_used = Gauge("k3c_kv_pages_used", "MLA pages held by sequences and checkpoints", registry=r)
        self.kv_usage = Gauge("k3c_kv_cache_usage", "fraction of the MLA page pool in use (vLLM's kv_cache_usage_perc)",
                              registry=r)
        self.prefix_pages = Gauge("k3c_prefix_cache_pages", "MLA pages held by prefix-cache checkpoints",
                                  registry=r)
        self.prefix_entries = Gauge("k3c_prefix_cache_checkpoints", "prefix-cache checkpoints by tier", ("tier",),
                                    registry=r)
        self.prefix_bytes = Gauge("k3c_prefix_cache_bytes", "prefix-cache bytes by tier (device: besides pages)",
                                  ("tier",), registry=r)
        self.hit_rate = Gauge("k3c_prefix_cache_hit_rate", "prompt tokens resumed / prompt tokens, since start",
                              registry=r)
        self.spec_drafted = Gauge("k3c_spec_draft_tokens", "draft tokens verified since start (speculation)",
                                  registry=r)
        self.spec_accepted = Gauge("k3c_spec_accepted_tokens", "draft tokens the model kept since start",
                                   registry=r)

    def observe_engine(self, engine) -> None:
        """Gauges from the engine's state (engine thread, after a step)."""
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting))
        pool = engine.pool
        self.pages_total.set(pool.num_pages)
        self.pages_used.set(pool.num_pages - pool.num_free)
        self.kv_usage.set((pool.num_pages - pool.num_free) / pool.num_pages if pool.num_pages else 0.0)
        cache = engine.prefix
        if cache is not None:
            self.prefix_pages.set(cache.device_pages())
            tiers = cache.tiers()
            for tier in ("device", "host", "disk"):
                self.prefix_entries.labels(tier).set(tiers.get(tier, 0))
                self.prefix_bytes.labels(tier).set(cache.tier_bytes(tier))
            self.hit_rate.set(cache.hit_rate())
        if getattr(engine, "speculation", None) is not None:
            self.spec_drafted.set(engine.stats.get("spec_drafted", 0))
            self.spec_accepted.set(engine.stats.get("spec_accepted", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
