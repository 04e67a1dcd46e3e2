"""Prometheus metrics for `/metrics`, updated from every engine-core outputs message.

Each is exported twice: as ``fluidserve_*``, and under vLLM's name (``vllm:*``, labelled
``model_name`` and ``engine``, as vLLM v1 labels them) where vLLM has the same quantity, so
that dashboards and autoscalers written for vLLM (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, the latency histograms) read fluidserve unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fluidserve.engine.messages import EngineCoreOutputs

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _Both:
    """A fluidserve metric and its vLLM twin, updated together."""

    def __init__(self, *metrics) -> None:
        self.metrics = metrics

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)

    def inc(self, value: float = 1) -> None:
        for m in self.metrics:
            m.inc(value)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str = "model") -> None:
        self.registry = r = CollectorRegistry()
        p = "fluidserve_"
        labels = {"model_name": model_name, "engine": "0"}

        def vllm(kind, name: str, doc: str, **kw):
            """vLLM's metric ``name``, with its labels set."""
            return kind("vllm:" + name, doc, list(labels), registry=r, **kw).labels(**labels)

        def both(kind, name: str, doc: str, vllm_name: str, **kw) -> _Both:
            return _Both(kind(p + name, doc, registry=r, **kw), vllm(kind, vllm_name, doc, **kw))

        self._vllm_success = Counter("vllm:request_success", "Finished requests by reason",
                                     [*labels, "finished_reason"], registry=r)
        self._labels = labels
        self.prompt_tokens = vllm(Counter, "prompt_tokens", "Prompt tokens of requests that"
                                  " produced their first token")
        self.request_prompt_tokens = vllm(Histogram, "request_prompt_tokens", "Prompt tokens"
                                          " per finished request", buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = vllm(
            Histogram, "request_generation_tokens", "Generated tokens per finished request",
            buckets=TOKEN_BUCKETS)
        self.queue_time = vllm(Histogram, "request_queue_time_seconds", "Arrival to first"
                               " scheduled (the scheduling delay), per finished request",
                               buckets=LATENCY_BUCKETS)
        self.requests = Counter(
            p + "requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.rejected = Counter(
            p + "requests_rejected", "Requests refused before admission", ["reason"], registry=r
        )
        self.running = both(Gauge, "num_requests_running", "Requests running",
                            "num_requests_running")
        self.waiting = both(Gauge, "num_requests_waiting", "Requests waiting",
                            "num_requests_waiting")
        self.kv_usage = both(Gauge, "kv_cache_usage", "Fraction of KV blocks in use",
                             "kv_cache_usage_perc")
        self.preemptions = both(Counter, "preemptions", "Preemptions (recompute)",
                                "num_preemptions")
        self.prefix_queries = both(
            Counter, "prefix_cache_queries", "Tokens of admitted requests looked up in the"
            " prefix cache (--enable-prefix-caching)", "prefix_cache_queries")
        self.prefix_hits = both(
            Counter, "prefix_cache_hits", "Tokens found in the prefix cache, not computed"
            " again", "prefix_cache_hits")
        self.token_budget = Gauge(p + "token_budget", "Token budget of the last iteration"
                                  " (chosen per iteration with --token-budget auto)", registry=r)
        self.slo_unreachable = Gauge(
            p + "tbt_slo_unreachable_iterations", "Iterations where even decode-only work was"
            " predicted to miss --tbt-slo (--token-budget auto)", registry=r)
        self.iteration_tokens = both(Histogram, "iteration_tokens", "Tokens per iteration",
                                     "iteration_tokens_total", buckets=TOKEN_BUCKETS)
        self.generated = both(Counter, "generation_tokens", "Generated tokens",
                              "generation_tokens")
        self.ttft = both(Histogram, "time_to_first_token_seconds", "TTFT",
                         "time_to_first_token_seconds", buckets=LATENCY_BUCKETS)
        self.tbt = both(Histogram, "time_between_tokens_seconds", "Gap between output tokens",
                        "inter_token_latency_seconds", buckets=LATENCY_BUCKETS)
        self.e2e = both(Histogram, "e2e_request_latency_seconds", "Arrival to last token",
                        "e2e_request_latency_seconds", buckets=LATENCY_BUCKETS)
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
                self.prompt_tokens.inc(d.num_prompt_tokens)  # (as vLLM counts them)
            elif d.tbt is not None:
                self.tbt.observe(d.tbt)
        for row in outs.finished:
            self.observe_finished(row)

    def observe_finished(self, row: dict) -> None:
        reason = row["finish_reason"] or "unknown"
        self.requests.labels(reason).inc()
        self._vllm_success.labels(**self._labels, finished_reason=reason).inc()
        self.request_prompt_tokens.observe(row["num_prompt_tokens"])
        self.request_generation_tokens.observe(row["num_output_tokens"])
        if row["scheduling_delay"] is not None:
            self.queue_time.observe(row["scheduling_delay"])
        if row["ttft"] is not None:
            self.e2e.observe(row["e2e"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
