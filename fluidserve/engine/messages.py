"""The typed messages between a front end (HTTP server, offline API) and an engine core.

The engine core is reached only through these: requests go in as ``AddRequest`` and
``AbortRequests``; every step comes back as ``EngineCoreOutputs`` (what changed for each request
that produced a token or ended, plus scheduler statistics). They hold plain Python values only,
so they cross a process boundary as they are (pickled over a pipe) and cost nothing in-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float | None = None  # engine clock; None: when the core receives it


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Requests sent together, the samples of one API request: pickled in one message, what
    their parameters share (``SamplingParams.token_lists``) is sent, and held, once."""

    requests: list[AddRequest]


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]
    reason: str = "abort"  # "stop" when the front end found a stop string


@dataclass(frozen=True, slots=True)
class FailAll:
    """End every unfinished request with this error (shutdown, drain timeout)."""

    message: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class ForceEos:
    """Testing: from now on, the output tokens at these indices are the request's EOS token
    (a model that "says" EOS where a test wants it); an empty set turns it off."""

    at: frozenset[int]


@dataclass(frozen=True, slots=True)
class InjectFault:
    """Testing: make the next ``times`` passes through a fault point raise.

    Points in the engine core: ``execute`` (inside the executor: the batch's requests fail, the
    core goes on); ``loop`` (the core's loop between iterations), ``command`` (applying a
    received message) and ``send`` (sending outputs): the core dies; ``wedge``: the core stops
    making progress without dying (the front end's watchdog must notice). The front end
    (``AsyncEngine.inject_fault``) has points of its own: ``output`` (processing one request's
    output: that request fails), ``metrics`` (updating metrics: logged and counted, nobody
    fails) and ``deliver`` (handing outputs to streams: every request fails, as if the core
    had died). A disaggregated instance adds ``kv_send`` (a prefill instance sending a request's
    KV) and ``kv_recv`` (a decode instance taking it in): that request fails, nothing else."""

    point: str
    times: int = 1


@dataclass(slots=True)
class RequestDelta:
    """One request's news from one step: a new token, an end, or both."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error, once finished
    error: str | None = None
    new_logprobs: list = field(default_factory=list)  # (logprob, [(id, logprob), ...])
    num_prompt_tokens: int = 0
    # Set with the first token and when finished: first scheduled - arrival, and, with prefix
    # caching, its prompt's tokens found cached when it was first admitted.
    scheduling_delay: float | None = None
    num_cached_tokens: int | None = None
    # The new token's latency (engine clock), for live metrics: from arrival for the first
    # output token (``ttft``), from the previous token for the others (``tbt``).
    ttft: float | None = None
    tbt: float | None = None
    # The error is the server's state (an instance that served it died), not the request's.
    unavailable: bool = False
    # With the first token, if asked: the prompt's tokens' (logprob, top, rank), from the
    # second on
    prompt_logprobs: list | None = None
    # Finished on one of ``stop_token_ids`` (not EOS, which comes first, as in vLLM): it
    stop_token: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # since start
    num_unfinished: int
    token_budget: int = 0  # of the last iteration (--token-budget auto chooses it each time)
    slo_unreachable: int = 0  # iterations where even decode-only work missed the TBT SLO
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up, since start
    prefix_cache_hits: int = 0  # of which found in the prefix cache


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[RequestDelta]
    stats: SchedulerStats | None = None
    iteration_tokens: list[int] = field(default_factory=list)  # per iteration completed
    finished: list[dict] = field(default_factory=list)  # telemetry rows of ended requests
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> reason
    # A disaggregated instance's control-plane events (fluidserve.disagg.messages) and, from a
    # decode instance, its load for the cluster monitor.
    events: list = field(default_factory=list)
    load: object = None
    # AddRequests the core (all instances, when disaggregated) had read when it made this
    # message: the front end counts those it sent since as waiting beside ``stats``.
    adds_seen: int = 0


@dataclass(frozen=True, slots=True)
class CoreReady:
    """Sent once by an engine-core process when its model is loaded."""

    model_dir: str
    max_model_len: int
    vocab_size: int | None
    num_kv_blocks: int
    block_size: int
    load_seconds: float


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """Sent by an engine-core process that cannot continue (startup or loop failure).
    ``config_error``: it could not start because of the user's input (the configuration, the
    model directory), and ``message`` says what, in one line."""

    message: str
    config_error: bool = False
