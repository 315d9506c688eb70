"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("openglm_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("openglm_requests_waiting", "Sequences queued for admission", registry=r)
        self.kv_used = Gauge("openglm_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("openglm_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.kv_cached = Gauge("openglm_kv_blocks_cached", "Hashed blocks reusable by the prefix cache", registry=r)
        self.prefix_hits = Gauge("openglm_prefix_cache_hit_blocks", "Prompt blocks served from the prefix cache",
                                 registry=r)
        self.prefix_queries = Gauge("openglm_prefix_cache_query_blocks", "Prompt blocks looked up", registry=r)
        self.preemptions = Gauge("openglm_preemptions", "Sequences preempted for recompute", registry=r)
        self.draft_tokens = Gauge("openglm_spec_decode_draft_tokens", "MTP draft tokens verified (cumulative)",
                                  registry=r)
        self.accepted_drafts = Gauge("openglm_spec_decode_accepted_tokens", "MTP draft tokens accepted (cumulative)",
                                     registry=r)
        self.tokens_per_s = Gauge("openglm_generation_tokens_per_second", "Generated tokens/s over recent steps",
                                  registry=r)
        self.prompt_tokens = Counter("openglm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.gen_tokens = Counter("openglm_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("openglm_requests", "Finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("openglm_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.ttft = Histogram("openglm_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("openglm_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.itl = Histogram("openglm_inter_token_latency_seconds", "Mean time between output tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self._window: list[tuple[float, int]] = []

    def observe_engine(self, engine) -> None:
        """Refresh the gauges from the engine (called by the engine thread on every pass of its loop)."""
        s = engine.stats()
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_used.set(s.kv_blocks_used)
        self.kv_total.set(s.kv_blocks_total)
        self.kv_cached.set(s.kv_blocks_cached)
        self.prefix_hits.set(s.prefix_hit_blocks)
        self.prefix_queries.set(s.prefix_query_blocks)
        self.preemptions.set(s.preemptions)
        self.draft_tokens.set(s.draft_tokens)
        self.accepted_drafts.set(s.accepted_draft_tokens)
        now, total = time.monotonic(), s.generation_tokens
        self._window = [(t, n) for t, n in self._window if now - t < 5.0] + [(now, total)]
        t0, n0 = self._window[0]
        self.tokens_per_s.set((total - n0) / (now - t0) if now > t0 else 0.0)

    def observe_itl(self, timing: dict, n_tokens: int) -> None:
        """A finished request's mean inter-token latency (first token to finish over the tokens after the first)."""
        first, done = timing.get("first_token_time"), timing.get("finished_time")
        if first is not None and done is not None and n_tokens > 1:
            self.itl.observe((done - first) / (n_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
