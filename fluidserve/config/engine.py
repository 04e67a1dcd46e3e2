"""The engine's knobs, by concern, and ``EngineConfig``, which holds them all."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from fluidserve.config.base import (
    DTYPES,
    SCHEDULERS,
    SLO_SCHEDULERS,
    ConfigError,
    check_device,
    check_threads,
    dtype_name,
    knob,
    require_positive,
)
from fluidserve.config.disagg import DisaggConfig


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs, in what precision, on what device, with which kernels."""

    model: str | None = knob(
        None, "Path to a Hugging Face-format model directory. Default: the embedded model."
    )
    tokenizer: str | None = knob(None, "Tokenizer directory (default: the model directory).")
    dtype: str = knob("auto", "Weight and activation dtype; auto: the checkpoint's own"
                      " (config.json torch_dtype; float16 runs as bfloat16 on the CPU);"
                      " half and float are float16 and float32, as in vLLM.",
                      choices=("auto", *DTYPES), parse=dtype_name)
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
    panel_product: str = knob(
        "auto", "The product of the AVX-512 panels (the linears with --linear-backend tiles on"
        " a CPU without AMX, and the prefill attention kernel of bf16 models): fma: bf16"
        " operands widened to float32 FMAs; dot: the bf16 dot product"
        " (VDPBF16PS, twice an FMA's multiply-adds; needs AVX-512 BF16); auto: dot where the"
        " CPU issues it at least 0.6x as fast as its FMA (measured once at start-up: AMD Zen 4"
        " ~1x, where dot runs 2.3x the FMA panels from 40 rows; an Emerald Rapids class Xeon"
        " 0.25x).",
        choices=("auto", "fma", "dot"))
    enforce_eager: bool = knob(
        False, "CUDA: run every step eagerly, with no CUDA graphs (by default decode-only"
        " batches replay graphs captured at start-up).")
    max_cudagraph_capture_size: int = knob(
        256, "CUDA: the largest decode batch captured in a CUDA graph (capped by"
        " --max-num-seqs); larger batches run eagerly.")
    warmup_max_rows: int = knob(
        2048, "CPU, oneDNN linears: at start-up, build oneDNN's kernel for every batch size"
        " (rounded as the engine pads batches) of up to this many tokens, capped by the token"
        " budget, so that no request's iteration waits for one (the first iteration of each"
        " size took 20-55 ms longer on a 2-core AMX Xeon with the 200M race model; the"
        " warm-up there: 0.8 s); 0: off.")

    def __post_init__(self) -> None:
        require_positive("max_cudagraph_capture_size", self.max_cudagraph_capture_size)
        if not isinstance(self.warmup_max_rows, int) or self.warmup_max_rows < 0:
            raise ConfigError(f"warmup_max_rows must be an integer >= 0, got"
                              f" {self.warmup_max_rows!r}")
        check_device(self.device)
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)},"
                              f" got {self.dtype!r}")
        if self.max_model_len is not None:
            require_positive("max_model_len", self.max_model_len)
        check_threads(self.num_threads)


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
    enable_prefix_caching: bool = knob(
        False, "Keep the KV of full blocks after their request ends and start a new request"
        " whose tokens begin the same way (a shared system prompt, an earlier turn of the"
        " chat, the other samples of n, a preempted request's own tokens) from it, computing"
        " only the rest; the blocks are reused for other tokens least recently freed first."
        " Not with --disaggregate. In `simulate`, whose requests are lengths, each prompt's"
        " tokens are its own but for the first --shared-prefix-len.")

    def __post_init__(self) -> None:
        require_positive("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            require_positive("num_kv_blocks", self.num_kv_blocks)
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
        require_positive("max_num_seqs", self.max_num_seqs)
        require_positive("tile_size", self.tile_size)
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
        require_positive("token_budget", self.token_budget)
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
    disable_custom_all_reduce: bool = knob(
        False, "CPU: tensor-parallel ranks on one host all-reduce through gloo (loopback TCP)"
        " instead of a shared-memory mapping (by default they use one where every rank of the"
        " group is on this host and /dev/shm holds it).")

    def __post_init__(self) -> None:
        require_positive("tensor_parallel_size", self.tensor_parallel_size)
        require_positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
        if self.cache.enable_prefix_caching and self.disagg.disaggregate:
            raise ConfigError("--enable-prefix-caching does not combine with --disaggregate"
                              " (a decode instance's blocks arrive from a prefill instance)")
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
