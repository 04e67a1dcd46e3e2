"""TetriInfer's knobs: disaggregated prefill and decode instances."""

from __future__ import annotations

from dataclasses import dataclass

from fluidserve.config.base import (
    ConfigError,
    knob,
    require_finite,
    require_positive,
)

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
        require_positive("num_prefill_instances", self.num_prefill_instances)
        require_positive("num_decode_instances", self.num_decode_instances)
        require_positive("prefill_chunk_size", self.prefill_chunk_size)
        require_positive("predictor_granularity", self.predictor_granularity)
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
        if self.kv_transfer_bandwidth_gbps is not None:
            require_finite("kv_transfer_bandwidth_gbps", self.kv_transfer_bandwidth_gbps)
        require_finite("kv_transfer_latency", self.kv_transfer_latency, zero_ok=True)
        for name in ("monitor_interval", "flip_window", "kv_transfer_timeout"):
            require_finite(name, getattr(self, name))
