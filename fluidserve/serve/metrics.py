"""Prometheus metrics for `/metrics`, updated from every engine-core outputs message."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fluidserve.engine.messages import EngineCoreOutputs

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "fluidserve_"
        self.requests = Counter(
            p + "requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.rejected = Counter(
            p + "requests_rejected", "Requests refused before admission", ["reason"], registry=r
        )
        self.running = Gauge(p + "num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage", "Fraction of KV blocks in use", registry=r)
        self.preemptions = Counter(p + "preemptions", "Preemptions (recompute)", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Tokens of admitted requests looked up in the prefix"
            " cache (--enable-prefix-caching)", registry=r)
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Tokens found in the prefix cache, not computed again",
            registry=r)
        self.token_budget = Gauge(p + "token_budget", "Token budget of the last iteration"
                                  " (chosen per iteration with --token-budget auto)", registry=r)
        self.slo_unreachable = Gauge(
            p + "tbt_slo_unreachable_iterations", "Iterations where even decode-only work was"
            " predicted to miss --tbt-slo (--token-budget auto)", registry=r)
        self.iteration_tokens = Histogram(
            p + "iteration_tokens", "Tokens per iteration", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generated = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tbt = Histogram(
            p + "time_between_tokens_seconds",
            "Gap between output tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.internal_errors = Counter(
            p + "internal_errors", "Front-end errors caught and survived, by where", ["where"],
            registry=r,
        )
        self._preempted = self._queried = self._hit = 0

    def observe(self, outs: EngineCoreOutputs) -> None:
        """Update from one engine-core outputs message (called on the client's reader thread)."""
        if outs.stats is not None:
            st = outs.stats
            self.running.set(st.num_running)
            self.waiting.set(st.num_waiting)
            self.kv_usage.set(st.kv_cache_usage)
            self.preemptions.inc(st.num_preemptions - self._preempted)
            self._preempted = st.num_preemptions
            self.prefix_queries.inc(st.prefix_cache_queries - self._queried)
            self.prefix_hits.inc(st.prefix_cache_hits - self._hit)
            self._queried, self._hit = st.prefix_cache_queries, st.prefix_cache_hits
            self.token_budget.set(st.token_budget)
            self.slo_unreachable.set(st.slo_unreachable)
        for n in outs.iteration_tokens:
            self.iteration_tokens.observe(n)
        self.generated.inc(sum(len(d.new_token_ids) for d in outs.outputs))
        for d in outs.outputs:  # as each token comes, not when its request ends
            if d.ttft is not None:
                self.ttft.observe(d.ttft)
            elif d.tbt is not None:
                self.tbt.observe(d.tbt)
        for row in outs.finished:
            self.observe_finished(row)

    def observe_finished(self, row: dict) -> None:
        self.requests.labels(row["finish_reason"] or "unknown").inc()
        if row["ttft"] is not None:
            self.e2e.observe(row["e2e"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
