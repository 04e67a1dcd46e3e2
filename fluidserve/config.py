"""Every user-facing knob, as frozen dataclasses validated once in ``__post_init__``.

The CLI is generated from these fields (see ``fluidserve/cli_args.py``): the help text of a
flag is the ``help`` metadata of its field, so a knob is documented exactly once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

# Policies that run with a fixed token budget (sarathi_slack needs --token-budget auto).
SCHEDULERS = (
    "sarathi",
    "vllm",
    "orca",
    "faster_transformer",
    "decode_maximal",
    "hybrid_only",
    "chunked_only",
)
SLO_SCHEDULERS = ("sarathi_slack",)  # need --token-budget auto --tbt-slo
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the knob and the reason."""


def is_config_error(e: BaseException) -> bool:
    """Whether ``e`` says what is wrong with the user's input (a knob, the model directory,
    a value the model's shape rules out): told as one line, not a traceback."""
    from fluidserve.model.arch import ModelLoadError

    return isinstance(e, (ConfigError, ModelLoadError)) or type(e) is ValueError


def knob(default, help: str, **kw):  # noqa: A002 - "help" mirrors argparse
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs, in what precision, on what device, with which kernels."""

    model: str | None = knob(
        None, "Path to a Hugging Face-format model directory. Default: the embedded model."
    )
    tokenizer: str | None = knob(None, "Tokenizer directory (default: the model directory).")
    dtype: str = knob("auto", "Weight and activation dtype; auto: the checkpoint's own"
                      " (config.json torch_dtype; float16 runs as bfloat16 on the CPU).",
                      choices=("auto", *DTYPES))
    device: str = knob("cpu", "Torch device: cpu, cuda, cuda:N.")
    seed: int = knob(0, "Sampling seed for requests that do not carry one.")
    max_model_len: int | None = knob(
        None, "Context window in tokens (default and upper bound: the model's"
        " max_position_embeddings)."
    )
    num_threads: int | None = knob(
        None, "Torch intra-op threads on CPU, per worker process (default: torch's).")
    attention_backend: str = knob(
        "auto", "native: the compiled CPU kernels for attention and the fused operators (built"
        " once per machine); triton: their Triton counterparts on CUDA; eager: PyTorch"
        " reference code; auto: native on the CPU, triton on CUDA, where each can run.",
        choices=("auto", "native", "triton", "eager"))
    linear_backend: str = knob(
        "auto", "packed: oneDNN linear layers on weights prepacked at load (CPU; bf16 and"
        " fp16 weights widened to float32 where the CPU has no instructions for them);"
        " tiles: bf16 weights laid out for the compiled kernels' own linear: on an AMX CPU"
        " batches of up to 64 tokens multiply on a second copy in AMX tiles (their products"
        " ~20% faster at 1-64 rows; twice the linear weights' memory), on an AVX-512 or AVX2"
        " CPU every batch multiplies on one copy in 32- or 16-column panels (float32 FMAs;"
        " AVX-512 without AMX: 1.2-1.7x oneDNN's bf16 kernels at 1-2048 rows; AVX2: 2-3x"
        " oneDNN on widened weights at 1-16 rows, 1.3x at 40, even from 256); eager:"
        " F.linear; auto: tiles for bfloat16 where the CPU has AMX and the copy takes at most"
        " a quarter of the available memory, has AVX-512 (without AMX), or has AVX2 but no"
        " bf16 instructions; else packed.",
        choices=("auto", "tiles", "packed", "eager"))
    enforce_eager: bool = knob(
        False, "CUDA: run every step eagerly, with no CUDA graphs (by default decode-only"
        " batches replay graphs captured at start-up).")
    max_cudagraph_capture_size: int = knob(
        256, "CUDA: the largest decode batch captured in a CUDA graph (capped by"
        " --max-num-seqs); larger batches run eagerly.")

    def __post_init__(self) -> None:
        _positive("max_cudagraph_capture_size", self.max_cudagraph_capture_size)
        _check_device(self.device)
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)},"
                              f" got {self.dtype!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = knob(16, "Tokens per KV-cache block.")
    num_kv_blocks: int | None = knob(
        None, "KV-cache blocks (default: derived from --kv-cache-memory-gb)."
    )
    kv_cache_memory_gb: float = knob(
        1.0, "Memory for the KV cache in GiB (per worker), used when --num-kv-blocks is not"
        " given; at most what --max-num-seqs sequences of the context window can fill.")
    watermark: float = knob(0.01, "Fraction of KV blocks kept free when admitting new requests.")

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if not (self.kv_cache_memory_gb > 0 and math.isfinite(self.kv_cache_memory_gb)):
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How each iteration's batch is chosen."""

    policy: str = knob("sarathi", "Batching policy.", choices=SCHEDULERS + SLO_SCHEDULERS,
                       flag="--scheduler")
    token_budget: int | str = knob(
        512,
        "Tokens per iteration (prefill chunk tokens + decodes). For vllm/chunked_only it caps"
        " the prefill tokens of one prefill iteration. 'auto' (sarathi, decode_maximal;"
        " sarathi_slack requires it): before each iteration, the largest budget predicted to"
        " keep it within --tbt-slo.",
        aliases=("--max-num-batched-tokens",), parse=lambda v: v if v == "auto" else int(v),
    )
    tbt_slo: float | None = knob(
        None, "With --token-budget auto: the time-between-tokens SLO (s) every iteration is"
        " planned to meet. In `simulate` also the P99 TBT bound of --capacity and"
        " --find-token-budget (default there 0.5).")
    budget_margin: float = knob(
        0.1, "With --token-budget auto: iterations are planned for (1 - margin) x --tbt-slo.")
    max_num_seqs: int = knob(128, "Maximum number of running requests.")
    tile_size: int = knob(
        1, "Round prefill chunk sizes down to a multiple of this (1 = no rounding)."
    )
    queue_policy: str = knob("fcfs", "Order of the waiting queue.", choices=("fcfs", "sjf", "ljf"))
    queue_window: int = knob(
        16, "Arrivals per sorting window of the waiting queue (as TetriInfer's"
        " PrefillSchedBatch): sjf/ljf sort within a window, windows run in arrival order, so a"
        " long prompt under sjf waits for its own window at most (0: one window; it may wait"
        " for as long as shorter prompts keep arriving). Disaggregated prefill instances use"
        " --prefill-sched-batch instead.")
    async_scheduling: bool | None = knob(
        None, "Schedule and launch the next iteration while the last one still runs: a"
        " request's next decode reads the token in flight on the device, so the host's work"
        " between iterations (applying tokens, streaming, scheduling, building inputs)"
        " overlaps the device's instead of leaving it idle. A token sampled after its request"
        " stopped (EOS, a stop token or string) is computed and dropped. For CUDA: on the CPU"
        " a batch runs when it is launched, so nothing overlaps and each token reaches its"
        " stream one iteration later. One model process only (no --tensor/"
        "--pipeline-parallel-size > 1, no --disaggregate). Default: on with --device cuda"
        " in one model process, off elsewhere (as vLLM).")

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULERS + SLO_SCHEDULERS:
            raise ConfigError(f"scheduler must be one of"
                              f" {', '.join(SCHEDULERS + SLO_SCHEDULERS)}, got {self.policy!r}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("tile_size", self.tile_size)
        if self.queue_window < 0:
            raise ConfigError("queue_window must be >= 0")
        if self.token_budget == "auto":
            if self.tbt_slo is None or not self.tbt_slo > 0:
                raise ConfigError("--token-budget auto needs --tbt-slo (seconds, > 0)")
            if self.policy not in ("sarathi", "sarathi_slack", "decode_maximal"):
                raise ConfigError("--token-budget auto needs a chunked hybrid-batch scheduler"
                                  f" (sarathi, sarathi_slack, decode_maximal), not"
                                  f" {self.policy}")
            if not 0 <= self.budget_margin < 1:
                raise ConfigError("budget_margin must be in [0, 1)")
            return
        if self.policy == "sarathi_slack":
            raise ConfigError("sarathi_slack plans with the iteration-time prediction of"
                              " --token-budget auto: give --token-budget auto --tbt-slo S")
        if not isinstance(self.token_budget, int) or isinstance(self.token_budget, bool):
            raise ConfigError(f"token_budget must be an integer or 'auto', got"
                              f" {self.token_budget!r}")
        _positive("token_budget", self.token_budget)
        if self.tile_size > self.token_budget:
            raise ConfigError(
                f"tile_size ({self.tile_size}) must not exceed token_budget ({self.token_budget})"
            )


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over worker processes (shared by serve, generate and simulate)."""

    tensor_parallel_size: int = knob(
        1, "Tensor-parallel ranks per pipeline stage (attention heads and MLP split"
        " Megatron-style, all-reduce after each block).", aliases=("-tp",))
    pipeline_parallel_size: int = knob(
        1, "Pipeline stages (layers split evenly; as many micro-batches in flight as stages).",
        aliases=("-pp",))
    distributed_executor_backend: str = knob(
        "mp", "Launcher of the worker processes when tp x pp > 1, and of the instances with"
        " --disaggregate: mp (local processes) or ray (Ray actors on an existing cluster, or a"
        " local one; pip install fluidserve[ray]).",
        choices=EXECUTOR_BACKENDS)

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


PREFILL_POLICIES = ("fcfs", "sjf", "ljf")
LENGTH_PREDICTORS = ("oracle", "noisy", "learned")
DISPATCHERS = ("power_of_two", "random", "round_robin", "least_loaded")
DECODE_ADMISSIONS = ("greedy", "reserve_static", "reserve_dynamic")
KV_TRANSFER_GRANULARITIES = ("request", "chunk")
KV_TRANSPORTS = ("gloo", "shm")


@dataclass(frozen=True)
class DisaggConfig:
    """TetriInfer: disaggregated prefill and decode instances (fluidserve/disagg/)."""

    disaggregate: bool = knob(False, "Run separate prefill and decode instances (TetriInfer)"
                              " instead of one colocated engine.")
    num_prefill_instances: int = knob(1, "Prefill instances (with --disaggregate).")
    num_decode_instances: int = knob(1, "Decode instances (with --disaggregate).")
    prefill_chunk_size: int = knob(
        512, "Tokens per prefill iteration on a prefill instance (TetriInfer's ChunkSize: the"
        " batch size that saturates the device; see `fluidserve profile`'s knee).")
    prefill_policy: str = knob("fcfs", "Order of a prefill instance's local queue.",
                               choices=PREFILL_POLICIES)
    prefill_sched_batch: int = knob(
        16, "Arrivals per sorting window of the prefill queue (TetriInfer's PrefillSchedBatch):"
        " sjf/ljf sort within a window, windows run in arrival order, so nothing starves"
        " (0: one window).")
    length_predictor: str = knob("noisy", "Generated-length predictor at the prefill instance:"
                                 " oracle (the true length; served: max_tokens), noisy (oracle"
                                 " right with --predictor-accuracy, else a neighbouring"
                                 " bucket) or learned (fitted on a request log).",
                                 choices=LENGTH_PREDICTORS)
    length_predictor_path: str | None = knob(
        None, "The learned predictor's file (`fluidserve train-predictor`), for"
        " --length-predictor learned.")
    predictor_granularity: int = knob(200, "Width of a predicted-length bucket (tokens).")
    predictor_accuracy: float = knob(0.749, "Accuracy of the noisy predictor (TetriInfer's"
                                     " OPT-125M classifier: 74.9% at granularity 200).")
    dispatcher: str = knob("power_of_two", "How a prefill instance picks a decode instance.",
                           choices=DISPATCHERS)
    decode_admission: str = knob("reserve_dynamic", "When a decode instance lets a prefilled"
                                 " request in: greedy (its current KV fits), reserve_static"
                                 " (its predicted final KV fits) or reserve_dynamic (that, after"
                                 " the running requests' predicted growth).",
                                 choices=DECODE_ADMISSIONS)
    heavy_decode_threshold: int = knob(200, "A decode is heavy when its predicted length is"
                                       " above this (tokens).")
    kv_transfer_granularity: str = knob(
        "request", "Send a request's KV when its prefill ends (request) or each chunk as it is"
        " prefilled (chunk: the transfer overlaps the prefill; what the link has not carried"
        " by its end, and at least the last chunk, remains).",
        choices=KV_TRANSFER_GRANULARITIES)
    kv_transfer_bandwidth_gbps: float | None = knob(
        None, "Simulation: KV-transfer bandwidth between instances, in gigabytes (not bits)"
        " per second (default: the device's measured send/recv between two GPUs of one node,"
        " e.g. ~286 GB/s NVLink on A100s). Served instances move KV as fast as --kv-transport"
        " does.")
    kv_transfer_latency: float = knob(20e-6, "Simulation: fixed cost of one KV transfer"
                                      " (seconds).")
    kv_transport: str = knob("gloo", "How served instances move KV: gloo (torch.distributed"
                             " point-to-point) or shm (shared memory, same host).",
                             choices=KV_TRANSPORTS)
    kv_transfer_timeout: float = knob(60.0, "Seconds a served KV transfer may take before its"
                                      " request fails with an error.")
    monitor_interval: float = knob(0.1, "Seconds between the cluster monitor's load broadcasts.")
    instance_flip: bool = knob(False, "Let an instance drain and change role when the load"
                               " between prefill and decode stays unbalanced.")
    flip_window: float = knob(2.0, "Seconds an imbalance must last before an instance flips.")
    flip_prefill_backlog: float = knob(
        8.0, "Prefill backlog (queued tokens per prefill instance, in chunks) above which"
        " prefill is short of instances.")

    def __post_init__(self) -> None:
        _positive("num_prefill_instances", self.num_prefill_instances)
        _positive("num_decode_instances", self.num_decode_instances)
        _positive("prefill_chunk_size", self.prefill_chunk_size)
        _positive("predictor_granularity", self.predictor_granularity)
        if self.prefill_sched_batch < 0:
            raise ConfigError("prefill_sched_batch must be >= 0")
        for name, value, options in (
                ("prefill_policy", self.prefill_policy, PREFILL_POLICIES),
                ("length_predictor", self.length_predictor, LENGTH_PREDICTORS),
                ("dispatcher", self.dispatcher, DISPATCHERS),
                ("decode_admission", self.decode_admission, DECODE_ADMISSIONS),
                ("kv_transfer_granularity", self.kv_transfer_granularity,
                 KV_TRANSFER_GRANULARITIES),
                ("kv_transport", self.kv_transport, KV_TRANSPORTS)):
            if value not in options:
                raise ConfigError(f"{name} must be one of {options}, got {value!r}")
        if (self.length_predictor == "learned") != (self.length_predictor_path is not None):
            raise ConfigError("--length-predictor learned needs --length-predictor-path (and"
                              " the path is for the learned predictor only)")
        if not 0.0 <= self.predictor_accuracy <= 1.0:
            raise ConfigError("predictor_accuracy must be in [0, 1]")
        if self.kv_transfer_bandwidth_gbps is not None and self.kv_transfer_bandwidth_gbps <= 0:
            raise ConfigError("kv_transfer_bandwidth_gbps must be > 0")
        if self.kv_transfer_latency < 0:
            raise ConfigError("kv_transfer_latency must be >= 0")
        if self.monitor_interval <= 0 or self.flip_window <= 0:
            raise ConfigError("monitor_interval and flip_window must be > 0")
        if self.kv_transfer_timeout <= 0:
            raise ConfigError("kv_transfer_timeout must be > 0")


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "parallel": ParallelConfig, "disagg": DisaggConfig}


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine core needs, by concern. ``EngineConfig.create(**knobs)`` takes the
    flat knob names (``token_budget=256``, ``scheduler="vllm"``, ``tensor_parallel_size=2``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    @classmethod
    def create(cls, **knobs) -> EngineConfig:
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in knobs.items():
            section, name = _KNOB_SECTION.get(key, (None, key))
            if section is None:
                raise TypeError(f"unknown engine option {key!r}; valid: {sorted(_KNOB_SECTION)}")
            parts[section][name] = value
        return cls(**{name: SECTIONS[name](**kw) for name, kw in parts.items()})

    def __post_init__(self) -> None:
        if self.scheduler.async_scheduling and (self.parallel.world_size > 1
                                                or self.disagg.disaggregate):
            raise ConfigError("--async-scheduling runs the model in one process: it does not"
                              " combine with --tensor-parallel-size/--pipeline-parallel-size"
                              " > 1 or --disaggregate")
        if self.disagg.disaggregate:
            sc = self.scheduler
            moot = [flag for flag, given in (
                ("--scheduler", sc.policy != SchedulerConfig.policy),
                ("--token-budget auto", sc.token_budget == "auto")) if given]
            if moot:
                raise ConfigError(
                    f"--disaggregate runs TetriInfer's own schedulers (prefill instances:"
                    f" --prefill-policy, --prefill-chunk-size; decode instances:"
                    f" --decode-admission under a fixed --token-budget, their waiting"
                    f" requests in --queue-policy order): {', '.join(moot)}"
                    f" would be ignored")

    def uses_async_scheduling(self) -> bool:
        """``--async-scheduling`` as given, else on for one model process on CUDA."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        return (self.model.device.startswith("cuda") and self.parallel.world_size == 1
                and not self.disagg.disaggregate)

    def knobs(self) -> dict:
        """The flat knob names and values (the inverse of ``create``)."""
        return {key: getattr(getattr(self, section), name)
                for key, (section, name) in _KNOB_SECTION.items()}

    def replace(self, **knobs) -> EngineConfig:
        return EngineConfig.create(**(self.knobs() | knobs))


def _knob_sections() -> dict[str, tuple[str, str]]:
    out = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            out[flag[2:].replace("-", "_")] = (section, f.name)
    return out


_KNOB_SECTION = _knob_sections()


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server knobs of `fluidserve serve` (the engine's come from EngineConfig)."""

    host: str = knob("127.0.0.1", "Address to bind.")
    port: int = knob(8000, "Port to bind.")
    served_model_name: str | None = knob(
        None, "Model name clients must use (default: the model directory's name)."
    )
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
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        _positive("max_waiting_requests", self.max_waiting_requests)
        if self.drain_timeout < 0:
            raise ConfigError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty")
        if self.protect_metrics and self.api_key is None:
            raise ConfigError("protect_metrics needs api_key")
        _positive("max_request_bytes", self.max_request_bytes)
        if not (self.watchdog_timeout > 0 and math.isfinite(self.watchdog_timeout)):
            raise ConfigError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")


def _check_device(device: str) -> None:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")



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
    api_key: str | None = knob(None, "Bearer token for the server.")
    dataset_name: str = knob(
        "sharegpt", aliases=("--trace",), help=
        "Lengths: sharegpt, arxiv, bwb, splitwise_conv, splitwise_code (trace files, or built-in"
        " stand-ins when absent), fixed, uniform, zipf, TetriInfer LPLD/LPHD/HPLD/HPHD/mixed.",
    )
    dataset_path: str | None = knob(
        None, "CSV with num_prefill_tokens,num_decode_tokens[,arrived_at]: the trace to"
        " replay (in place of --dataset-name's file), or the pool the TetriInfer classes are"
        " drawn from; not with fixed, uniform or zipf lengths."
    )
    num_prompts: int = knob(100, "Requests to send.")
    input_len: int | None = knob(None, "Prompt length: the mean with --dataset-name uniform,"
                                 " else a fixed length (implies --dataset-name fixed).")
    output_len: int | None = knob(None, "Output length: the mean with --dataset-name uniform,"
                                  " else a fixed length (implies --dataset-name fixed).")
    range_ratio: float = knob(0.5, "uniform: lengths in [(1-r)L, (1+r)L].")
    prompt_scale: float = knob(1.0, "Multiply trace prompt lengths by this.")
    output_scale: float = knob(1.0, "Multiply trace output lengths by this.")
    max_prompt_len: int = knob(2048, "Clip prompt lengths to this.")
    max_output_len: int = knob(1024, "Clip output lengths to this.")
    request_rate: float = knob(math.inf, "Requests/s (inf: all at once).")
    burstiness: float = knob(1.0, "Gamma shape of inter-arrival times (1 = Poisson; CV = 1/sqrt).")
    arrivals: str = knob("rate", "rate, or trace (the trace's own timestamps).",
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
        _positive("num_prompts", self.num_prompts)
        if self.max_concurrency is not None:
            _positive("max_concurrency", self.max_concurrency)
        for name in ("ttft_deadline", "tbt_deadline", "timeout", "burstiness"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.ttft_slack >= 0:
            raise ConfigError(f"ttft_slack must be >= 0, got {self.ttft_slack}")


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
        if not self.start_rate > 0:
            raise ConfigError("start_rate must be > 0")
        if self.min_rate is not None and not 0 < self.min_rate <= self.start_rate:
            raise ConfigError(f"min_rate must be in (0, start_rate = {self.start_rate:g}],"
                              f" got {self.min_rate:g}")
        _positive("max_probes", self.max_probes)
        if self.slo_percentile not in SLO_PERCENTILES:
            raise ConfigError(f"slo_percentile must be one of {SLO_PERCENTILES} (the"
                              f" percentiles a run's summary carries), got"
                              f" {self.slo_percentile:g}")

    @property
    def lowest_rate(self) -> float:
        return self.start_rate / 16 if self.min_rate is None else self.min_rate


@dataclass(frozen=True)
class SimConfig:
    """Simulator knobs of `fluidserve simulate` (scheduler knobs come from EngineConfig,
    the workload from BenchConfig and SLOs from CapacityConfig, under the same flag names)."""

    cost_model: str = knob("gpu", "gpu: measured operator tables + modelled attention and"
                           " communication; cpu: fitted from a `fluidserve profile` JSON.",
                           choices=("gpu", "cpu"))
    model_shape: str = knob("mistral-7b", "Model shape for the gpu cost model.")
    device: str = knob("a100", "GPU for the gpu cost model: a100, h100, a40.")
    cpu_profile: str | None = knob(
        None, "profile.json (`fluidserve profile`) for the cpu cost model, or a shipped one"
        " of the 250M bf16 model: epyc-zen3 (2-core AMD EPYC, AVX2) or xeon-emr (2-core Xeon,"
        " AVX-512 without AMX). Default: the shipped one nearest this CPU.")
    cpu_calibration: str | None = knob(
        None, "Comma-separated engine telemetry files (`fluidserve serve --telemetry-file`)"
        " to refit the cpu cost model on served iterations.")
    cpu_jitter: bool = knob(True, "With --cpu-calibration: scale each simulated iteration by a"
                            " served/fitted time ratio of the calibration, drawn with --seed,"
                            " so tails include the machine's variability (--no-cpu-jitter: the"
                            " mean time).")
    cpu_jitter_seed: int | None = knob(
        None, "Seed of the --cpu-jitter draws (default: --seed): the same workload with other"
        " draws, to see how much of a simulated tail is the draw.")
    gpu_memory_utilization: float = knob(0.9, "Fraction of GPU memory for weights + KV cache.")
    pipeline_across_nodes: bool = knob(
        False, "gpu cost model with --pipeline-parallel-size > 1: every stage on a node of its"
        " own (hops priced with the two-node send/recv profile; default: the GPUs of one node,"
        " over NVLink). Tensor-parallel all-reduces stay within a node.")
    max_model_len: int = knob(16384, "Context window of the simulated engine (tokens).")
    capacity: bool = knob(False, "Search the capacity (max QPS meeting the SLO) instead.")
    find_token_budget: bool = knob(False, "Print the largest token budget meeting --tbt-slo.")
    budget_decodes: int = knob(32, "--find-token-budget: decodes in the reference batch.")
    budget_context: int = knob(1024, "--find-token-budget: context of those decodes and the"
                               " prefix of the prefill chunk.")
    max_budget: int = knob(8192, "--find-token-budget: largest budget considered.")

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        _positive("budget_decodes", self.budget_decodes)
        _positive("max_budget", self.max_budget)
        _positive("max_model_len", self.max_model_len)
        if self.budget_context < 0:
            raise ConfigError("budget_context must be >= 0")


def _model_shapes() -> list[str]:
    from fluidserve.model.builder import SHAPES

    return sorted(SHAPES)


@dataclass(frozen=True)
class ProfileConfig:
    """Knobs of `fluidserve profile` (the engine characterization benchmark)."""

    model: str | None = knob(None, "Model directory (default: build the --shape benchmark model).")
    shape: str = knob("250m", "Benchmark model shape when --model is not given.",
                      choices=_model_shapes)
    dtype: str = knob("bfloat16", "Weight dtype.", choices=DTYPES)
    device: str = knob("cpu", "Torch device.")
    num_threads: int | None = knob(None, "Torch intra-op threads (default: torch's).")
    repeats: int = knob(5, "Timed rounds; each visits every point once, in a shuffled order"
                        " (a point reports its median over the rounds).")
    quick: bool = knob(False, "Small sweeps (a smoke run).")
    output_dir: str | None = knob(None, "Output directory (default: runs/profile-<time>).")
    plots: bool = knob(True, "Write PNG plots.")

    def __post_init__(self) -> None:
        _positive("repeats", self.repeats)
        _check_device(self.device)


@dataclass(frozen=True)
class PredictorTrainConfig:
    """Knobs of `fluidserve train-predictor` (the learned generated-length predictor)."""

    request_log: str | None = knob(None, "Request log(s) written by `fluidserve serve"
                                   " --request-log` (comma-separated).")
    out: str = knob("length-predictor.json", "Where to write the predictor.")
    granularity: int = knob(200, "Width of a length bucket (tokens).")
    holdout: float = knob(0.2, "Share of the requests held out to measure accuracy.")
    seed: int = knob(0, "Seed of the held-out split.")

    def __post_init__(self) -> None:
        if not self.request_log:
            raise ConfigError("give the request log to learn from: --request-log FILE")
        _positive("granularity", self.granularity)
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"holdout must be in (0, 1), got {self.holdout}")


@dataclass(frozen=True)
class GenerateConfig:
    """Knobs of `fluidserve generate` besides the engine's: the prompts, how each is sampled
    (``SamplingParams``), and what is written."""

    prompt: tuple[str, ...] = knob((), "Prompt text (repeatable).", repeat=True)
    prompt_file: str | None = knob(None, "File with one prompt per line.")
    json: bool = knob(False, "One JSON object per prompt.")
    telemetry: str | None = knob(None, "Write per-iteration/per-token records (JSON lines).")
    max_tokens: int = knob(32, "Tokens to generate per prompt.")
    temperature: float = knob(0.0, "0 = greedy.")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(-1, "Sample from the k best (-1 = all).")
    sampling_seed: int | None = knob(None, "Per-request sampling seed.")
    stop: tuple[str, ...] = knob((), "Stop string (repeatable).", repeat=True)
    ignore_eos: bool = knob(False, "Keep generating past EOS.")


@dataclass(frozen=True)
class BuildModelConfig:
    """Knobs of `fluidserve build-model` (a random-weight Llama model directory)."""

    out: str | None = knob(None, "Output directory (required).")
    shape: str = knob("250m", "Model shape.", choices=_model_shapes)
    dtype: str = knob("bfloat16", "Weight dtype.", choices=("float32", "bfloat16", "float16"))
    seed: int = knob(0, "Seed of the random weights.")
    device: str = knob("cpu", "Draw the random weights here (cuda: seconds for an 8B model).")

    def __post_init__(self) -> None:
        _check_device(self.device)
        if not self.out:
            raise ConfigError("give the directory to write: --out DIR")
