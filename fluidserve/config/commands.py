"""The knobs of the other subcommands: simulate, profile, train-predictor, generate,
build-model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fluidserve.config.base import (
    DTYPES,
    ConfigError,
    check_device,
    check_threads,
    knob,
    require_positive,
)


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
        " of the 250M bf16 model: epyc-zen3 (2-core AMD EPYC, AVX2), epyc-zen4 (2-core AMD"
        " EPYC, AVX-512 BF16), xeon-emr (2-core Xeon, AVX-512 without AMX) or xeon-amx"
        " (2-core Xeon with AMX). Default: the shipped one nearest this CPU.")
    cpu_calibration: str | None = knob(
        None, "Comma-separated engine telemetry files (`fluidserve serve --telemetry-file`)"
        " to refit the cpu cost model on served iterations (served, as by default, on"
        " the profile's thread count).")
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
    max_model_len: int | None = knob(
        None, "Context window of the simulated engine (tokens; default: 16384 with the gpu cost"
        " model, with the cpu one the shipped profiles' model's, 4096: the requests its server"
        " would refuse are refused).")
    capacity: bool = knob(False, "Search the capacity (max QPS meeting the SLO) instead.")
    find_token_budget: bool = knob(False, "Print the largest token budget meeting --tbt-slo.")
    budget_decodes: int = knob(32, "--find-token-budget: decodes in the reference batch.")
    budget_context: int | None = knob(
        None, "--find-token-budget: context of those decodes and the prefix of the prefill"
        " chunk (default: 1024, or the context window less one where that is shorter).")
    max_budget: int = knob(8192, "--find-token-budget: largest budget considered.")

    def reference_context(self) -> int:
        """The context of --find-token-budget's reference decodes."""
        if self.budget_context is not None:
            return self.budget_context
        return min(1024, self.context_window() - 1)

    def context_window(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return _cpu_window() if self.cost_model == "cpu" else 16384

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        require_positive("budget_decodes", self.budget_decodes)
        require_positive("max_budget", self.max_budget)
        if self.max_model_len is not None:
            require_positive("max_model_len", self.max_model_len)
            if self.cost_model == "cpu" and self.max_model_len > _cpu_window():
                raise ConfigError(f"max_model_len {self.max_model_len} exceeds the"
                                  f" {_cpu_window()} positions of the model the cpu cost model"
                                  " prices (its server would refuse such requests)")
        if self.budget_context is not None and self.budget_context < 0:
            raise ConfigError("budget_context must be >= 0")
        if self.find_token_budget and self.reference_context() >= self.context_window():
            raise ConfigError(f"budget_context {self.budget_context} is not below the"
                              f" {self.context_window()}-token window (--max-model-len):"
                              " no request reaches it")
        if self.find_token_budget and self.max_budget < self.budget_decodes:
            raise ConfigError(f"max_budget {self.max_budget} is below budget_decodes"
                              f" {self.budget_decodes}: no budget fits the reference batch")
        if self.cost_model == "cpu":
            gpu_only = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(self)
                        if f.name in ("model_shape", "device", "gpu_memory_utilization")
                        and getattr(self, f.name) != f.default]
            if gpu_only:
                raise ConfigError(f"{', '.join(gpu_only)}: for the gpu cost model only (the cpu"
                                  " one prices the model of its --cpu-profile)")


# The model `fluidserve profile` builds by default, which the shipped CPU profiles measured:
# the cpu cost model prices it, with its window and its KV bytes.
PROFILED_SHAPE = "250m"


def profiled_shape():
    from fluidserve.model.builder import SHAPES

    return SHAPES[PROFILED_SHAPE]


def _cpu_window() -> int:
    return profiled_shape().max_position_embeddings


def _model_shapes() -> list[str]:
    from fluidserve.model.builder import SHAPES

    return sorted(SHAPES)


@dataclass(frozen=True)
class ProfileConfig:
    """Knobs of `fluidserve profile` (the engine characterization benchmark)."""

    model: str | None = knob(None, "Model directory (default: build the --shape benchmark model).")
    shape: str = knob(PROFILED_SHAPE, "Benchmark model shape when --model is not given.",
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
        require_positive("repeats", self.repeats)
        check_threads(self.num_threads)
        check_device(self.device)


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
        require_positive("granularity", self.granularity)
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
    n: int = knob(1, "Samples per prompt (sample j drawn with --sampling-seed + j).")
    temperature: float = knob(0.0, "0 = greedy.")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(-1, "Sample from the k best (-1 = all).")
    sampling_seed: int | None = knob(None, "Per-request sampling seed.")
    stop: tuple[str, ...] = knob((), "Stop string (repeatable).", repeat=True)
    ignore_eos: bool = knob(False, "Keep generating past EOS.")
    repetition_penalty: float = knob(
        1.0, "Divide the positive logits, multiply the negative ones, of every token in the"
        " prompt or the output by this (1 = off; vLLM's).")
    frequency_penalty: float = knob(
        0.0, "Subtract this times a token's count in the output from its logit, in [-2, 2].")
    presence_penalty: float = knob(
        0.0, "Subtract this from the logit of a token in the output, in [-2, 2].")
    min_p: float = knob(0.0, "Sample only tokens at least this times as likely as the best.")
    bad_words: tuple[str, ...] = knob(
        (), "A word the output may not contain, at its start or after a space (repeatable;"
        " vLLM's bad words).", repeat=True)


@dataclass(frozen=True)
class BuildModelConfig:
    """Knobs of `fluidserve build-model` (a random-weight Llama model directory)."""

    out: str | None = knob(None, "Output directory (required).")
    shape: str = knob("250m", "Model shape.", choices=_model_shapes)
    dtype: str = knob("bfloat16", "Weight dtype.", choices=("float32", "bfloat16", "float16"))
    seed: int = knob(0, "Seed of the random weights.")
    device: str = knob("cpu", "Draw the random weights here (cuda: seconds for an 8B model).")

    def __post_init__(self) -> None:
        check_device(self.device)
        if not self.out:
            raise ConfigError("give the directory to write: --out DIR")
