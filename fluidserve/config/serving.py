"""The knobs of the server and of the black-box evaluation (`serve`, `bench`, `capacity`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from fluidserve.config.base import (
    ConfigError,
    knob,
    require_finite,
    require_positive,
)


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server knobs of `fluidserve serve` (the engine's come from EngineConfig)."""

    host: str = knob("127.0.0.1", "Address to bind.")
    port: int = knob(8000, "Port to bind.")
    served_model_name: tuple[str, ...] = knob(
        (), "Model names clients may use (one or more, as vLLM's); responses carry the first"
        " (default: the model directory's name).", nargs="+")
    api_key: str | None = knob(
        None, "Require 'Authorization: Bearer <key>' on every /v1 route, checked before"
        " anything else (a request without it gets 401 whatever its body)."
    )
    protect_metrics: bool = knob(False, "With --api-key, require the key on /metrics too.")
    max_request_bytes: int = knob(
        4 * 1024 * 1024, "Request bodies larger than this get HTTP 413 before they are read."
    )
    max_waiting_requests: int = knob(
        1024, "Requests waiting for admission above which new ones get HTTP 503."
    )
    drain_timeout: float = knob(
        30.0, "Seconds SIGTERM waits for in-flight requests before failing them."
    )
    watchdog_timeout: float = knob(
        60.0, "Seconds the engine core may go without finishing an iteration while requests are"
        " in flight; after that the server fails them, turns /health to 503 and exits 1. Keep"
        " it above the longest iteration (a full token-budget prefill)."
    )
    log_requests: bool = knob(False, "Log one access line per HTTP request (uvicorn's access"
                              " log, /health and /metrics included).")
    request_log: str | None = knob(
        None, "Append one JSON line per finished request (prompt token ids, generated length)"
        " to this file: what `fluidserve train-predictor` learns from.")
    telemetry_file: str | None = knob(
        None, "Write per-iteration and per-request telemetry (JSON lines) here at shutdown"
        " (the engine keeps the last 100,000 records of each kind in memory until then)."
    )

    def __post_init__(self) -> None:
        names = self.served_model_name  # (one name, or none, as a string or None too)
        names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
        if any(not n for n in names):
            raise ConfigError("served_model_name: a name must not be empty")
        object.__setattr__(self, "served_model_name", names)
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        require_positive("max_waiting_requests", self.max_waiting_requests)
        require_finite("drain_timeout", self.drain_timeout, zero_ok=True)
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty")
        if self.protect_metrics and self.api_key is None:
            raise ConfigError("protect_metrics needs api_key")
        require_positive("max_request_bytes", self.max_request_bytes)
        require_finite("watchdog_timeout", self.watchdog_timeout)
        if self.telemetry_file is not None:  # written at shutdown: a bad path loses the run
            parent = Path(self.telemetry_file).expanduser().absolute().parent
            if not parent.is_dir() or not os.access(parent, os.W_OK):
                raise ConfigError(f"telemetry_file: cannot write in {parent} (no such"
                                  " directory, or not writable)")



@dataclass(frozen=True)
class BenchConfig:
    """Black-box evaluation of an OpenAI-compatible endpoint (`fluidserve bench`/`capacity`).

    Flag names follow `vllm bench serve` where the concept is shared.
    """

    base_url: str = knob("http://127.0.0.1:8000", "Server URL.")
    endpoint: str = knob("/v1/completions", "API route: /v1/completions or /v1/chat/completions.")
    model: str | None = knob(None, "Model name to send (default: the server's first model).")
    tokenizer: str | None = knob(
        None, "Tokenizer directory used to build prompts (default: the directory the server"
        " reports as its model's root when it has tokenizer files, else the embedded model's)."
    )
    api_key: str | None = knob(None, "Bearer token for the server (default: $OPENAI_API_KEY,"
                               " as vllm bench serve).")
    dataset_name: str = knob(
        "sharegpt", aliases=("--trace",), help=
        "Lengths: sharegpt, arxiv, bwb, splitwise_conv, splitwise_code (trace files, or built-in"
        " stand-ins when absent), fixed, uniform, zipf, random (vllm bench serve's: uniform with"
        " --random-range-ratio 0 by default), TetriInfer LPLD/LPHD/HPLD/HPHD/mixed.",
    )
    dataset_path: str | None = knob(
        None, "CSV with num_prefill_tokens,num_decode_tokens[,arrived_at]: the trace to"
        " replay (in place of --dataset-name's file), or the pool the TetriInfer classes are"
        " drawn from; not with fixed, uniform or zipf lengths."
    )
    num_prompts: int = knob(100, "Requests to send.")
    input_len: int | None = knob(None, "Prompt length: the mean with --dataset-name uniform or"
                                 " random, else a fixed length (implies --dataset-name fixed).",
                                 aliases=("--random-input-len",))
    output_len: int | None = knob(None, "Output length: the mean with --dataset-name uniform or"
                                  " random, else a fixed length (implies --dataset-name"
                                  " fixed).", aliases=("--random-output-len",))
    range_ratio: float | None = knob(None, "uniform and random: lengths in [(1-r)L, (1+r)L]"
                                     " (default: 0.5 for uniform, 0 for random, as vLLM's).",
                                     aliases=("--random-range-ratio",))
    prompt_scale: float = knob(1.0, "Multiply trace prompt lengths by this.")
    output_scale: float = knob(1.0, "Multiply trace output lengths by this.")
    max_prompt_len: int = knob(2048, "Clip prompt lengths to this.")
    max_output_len: int = knob(1024, "Clip output lengths to this.")
    shared_prefix_len: int = knob(
        0, "Every prompt opens with the same this many tokens (all of a shorter prompt's), the"
        " rest its own, as a shared system prompt: what a server's prefix caching finds."
        " Within the lengths drawn (vllm bench serve's --random-prefix-len adds its prefix to"
        " them). Each measured run (each capacity probe) draws another. `simulate` gives every"
        " prompt those tokens in common.")
    request_rate: float = knob(math.inf, "Requests/s (inf: all at once).", inf_ok=True)
    burstiness: float = knob(1.0, "Gamma shape of inter-arrival times (1 = Poisson; CV = 1/sqrt).")
    arrivals: str = knob("rate", "rate, or trace (the trace's own timestamps: --num-prompts"
                         " consecutive requests from a start --seed picks, scaled to a finite"
                         " --request-rate's mean).",
                         choices=("rate", "trace"))
    max_concurrency: int | None = knob(None, "Cap on requests in flight (closed loop).")
    seed: int = knob(0, "Workload seed: same seed, same workload.")
    ignore_eos: bool = knob(True, "Ask the server to ignore EOS so outputs have exact lengths.")
    temperature: float = knob(0.0, "Sampling temperature sent with each request.")
    ttft_deadline: float = knob(
        5.0, "Etalon D_p: target TTFT (s) for the fluidity-index, the same for every prompt"
        " (see --profile-prefill)."
    )
    tbt_deadline: float = knob(0.2, "Etalon D_d: target time between tokens (s) for the"
                               " fluidity-index (and --slo fluidity).")
    profile_prefill: bool = knob(
        False, "Etalon's D_p(prompt length) = the endpoint's isolated prefill time at that"
        " length (a fit of measured TTFTs) + --ttft-slack, instead of --ttft-deadline."
    )
    ttft_slack: float = knob(0.3, "With --profile-prefill: slack (s) added to the fitted"
                             " prefill time to make D_p.")
    warmup_requests: int = knob(2, "Requests sent (and excluded) before the measured run.")
    timeout: float = knob(600.0, "Per-request timeout (s): from sending a request to its"
                          " stream's end, whatever arrives in between.")
    output_dir: str | None = knob(None, "Run directory (default: runs/bench-<time>, runs/sim-"
                                  "<time> or runs/capacity-<time>).")
    plots: bool = knob(True, "Write PNG plots.")
    label: str | None = knob(None, "Name of this run in comparisons.")

    def __post_init__(self) -> None:
        if not self.endpoint.startswith("/"):
            raise ConfigError(f"endpoint must start with '/', got {self.endpoint!r}")
        if not (self.request_rate > 0):
            raise ConfigError("request_rate must be > 0 (inf for all at once)")
        require_positive("num_prompts", self.num_prompts)
        if self.max_concurrency is not None:
            require_positive("max_concurrency", self.max_concurrency)
        for name in ("ttft_deadline", "tbt_deadline", "timeout", "burstiness"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.ttft_slack >= 0:
            raise ConfigError(f"ttft_slack must be >= 0, got {self.ttft_slack}")
        for name in ("input_len", "output_len"):
            if getattr(self, name) is not None:
                require_positive(name, getattr(self, name))
        for name in ("max_prompt_len", "max_output_len"):
            require_positive(name, getattr(self, name))
        if self.shared_prefix_len < 0:
            raise ConfigError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        for name in ("prompt_scale", "output_scale"):
            require_finite(name, getattr(self, name))
        if self.warmup_requests < 0:
            raise ConfigError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


SLO_KINDS = ("tbt", "fluidity", "ttft", "tpot")
DELAY_METRICS = ("auto", "scheduling", "ttft")
SLO_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class CapacityConfig:
    """SLO and search knobs of `fluidserve capacity` (the workload comes from BenchConfig)."""

    slo: str = knob("tbt", "tbt: P99 TBT + median scheduling delay; fluidity: 99% of requests"
                    " with fluidity-index >= 0.9 (at --ttft-deadline / --profile-prefill and"
                    " --tbt-deadline); ttft / tpot: a percentile under a bound. Every kind also"
                    " requires that no request failed.", choices=SLO_KINDS)
    tbt_slo: float = knob(0.5, "P99 TBT bound (s) for --slo tbt.")
    max_scheduling_delay: float = knob(2.0, "Median scheduling-delay bound (s) for --slo tbt.")
    delay_metric: str = knob(
        "auto", "What --max-scheduling-delay bounds: scheduling (the delay the server reports"
        " in its stream's metrics; an error if it reports none), ttft (the time to first"
        " token, which any endpoint gives: use it to judge different engines alike), or auto"
        " (scheduling where reported, else ttft; the run records which).",
        choices=DELAY_METRICS)
    ttft_slo: float = knob(2.0, "TTFT bound (s) for --slo ttft.")
    tpot_slo: float = knob(0.2, "TPOT bound (s) for --slo tpot.")
    slo_percentile: float = knob(99.0, "Percentile for --slo ttft / tpot.",
                                 choices=SLO_PERCENTILES)
    start_rate: float = knob(1.0, "First request rate probed (req/s).")
    min_rate: float | None = knob(
        None, "Lowest rate probed when the SLO fails at --start-rate (default: --start-rate /"
        " 16; none in the simulator, whose probes cost no wall time); below it the search"
        " stops and reports no capacity (a served probe sends the whole workload, so it lasts"
        " about --num-prompts / rate seconds)."
    )
    granularity: float = knob(0.025, "Stop when (high - low) / low is below this.")
    max_probes: int = knob(20, "Stop after this many probes per variant.")
    server_startup_timeout: float = knob(300.0, "Seconds to wait for a launched server.")

    def __post_init__(self) -> None:
        if self.slo not in SLO_KINDS:
            raise ConfigError(f"slo must be one of {SLO_KINDS}")
        if not 0 < self.granularity < 1:
            raise ConfigError("granularity must be in (0, 1)")
        if self.delay_metric not in DELAY_METRICS:
            raise ConfigError(f"delay_metric must be one of {DELAY_METRICS}")
        for name in ("start_rate", "tbt_slo", "max_scheduling_delay", "ttft_slo", "tpot_slo"):
            require_finite(name, getattr(self, name))
        if self.min_rate is not None and not 0 < self.min_rate <= self.start_rate:
            raise ConfigError(f"min_rate must be in (0, start_rate = {self.start_rate:g}],"
                              f" got {self.min_rate:g}")
        require_positive("max_probes", self.max_probes)
        if self.slo_percentile not in SLO_PERCENTILES:
            raise ConfigError(f"slo_percentile must be one of {SLO_PERCENTILES} (the"
                              f" percentiles a run's summary carries), got"
                              f" {self.slo_percentile:g}")

    @property
    def lowest_rate(self) -> float:
        return self.start_rate / 16 if self.min_rate is None else self.min_rate
