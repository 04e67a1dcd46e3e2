"""Seeded workloads: request lengths (traces, stand-ins, synthetic) and arrival times.

A workload is a list of (arrival time, prompt length, output length). Length sources:
- the public traces (``sharegpt``, ``arxiv``, ``bwb``, ``splitwise_conv``, ``splitwise_code``)
  read from ../shared/data/traces when present, else sampled from quantile tables derived
  from them (``trace_stats.json``), so nothing breaks when the files are absent;
- ``fixed``, ``uniform`` and ``zipf`` synthetic distributions;
- TetriInfer's classes ``LPLD``/``LPHD``/``HPLD``/``HPHD`` (light/heavy prefill at 512 prompt
  tokens, light/heavy decode at 128 output tokens) and ``mixed`` (a quarter of each).
Arrivals: Poisson or gamma (``burstiness`` = gamma shape, CV = 1/sqrt(burstiness)), all at
once (rate inf), or the trace's own timestamps.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from fluidserve.data import data_dir

TRACE_FILES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "bwb": "bwb_stats_llama2_tokenizer_filtered_v2.csv",
    "splitwise_conv": "splitwise_conv.csv",
    "splitwise_code": "splitwise_code.csv",
}
TETRI_CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")
TETRI_PROMPT_THRESHOLD = 512
TETRI_DECODE_THRESHOLD = 128
SYNTHETIC = ("fixed", "uniform", "zipf")
DATASETS = (*TRACE_FILES, *SYNTHETIC, *TETRI_CLASSES, "mixed")


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    arrival: float  # seconds after the start of the run
    prompt_len: int
    output_len: int


@dataclass
class Trace:
    prompt: np.ndarray
    output: np.ndarray
    arrivals: np.ndarray | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "sharegpt"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.5
    zipf_theta: float = 1.2
    prompt_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt_len: int = 4096
    max_output_len: int = 2048
    request_rate: float = math.inf
    burstiness: float = 1.0
    arrivals: str = "rate"  # "rate" (Poisson/gamma/all-at-once) or "trace"
    tetri_base: str = "sharegpt"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS and not self.dataset_path:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}"
                             " or give --dataset-path")
        if self.dataset in SYNTHETIC and self.dataset_path:
            raise ValueError(f"--dataset-path gives the lengths of a trace; dataset"
                             f" {self.dataset!r} (--dataset-name, or --input-len/--output-len"
                             " which imply fixed) makes its own: give one or the other")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if min(self.input_len, self.output_len, self.max_prompt_len, self.max_output_len) < 1:
            raise ValueError("lengths must be >= 1")
        if not (self.request_rate > 0):
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got "
                             f"{self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.arrivals not in ("rate", "trace"):
            raise ValueError("arrivals must be 'rate' or 'trace'")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("range_ratio must be in [0, 1)")


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {path} " + ("is a directory, not a CSV file"
                                                   if path.is_dir() else "does not exist"))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "num_prefill_tokens" not in rows[0] or "num_decode_tokens" not in rows[0]:
        raise ValueError(f"{path}: need columns num_prefill_tokens and num_decode_tokens")
    prompt = np.array([int(float(r["num_prefill_tokens"])) for r in rows])
    output = np.array([int(float(r["num_decode_tokens"])) for r in rows])
    arrivals = None
    if "arrived_at" in rows[0]:
        arrivals = np.array([float(r["arrived_at"]) for r in rows])
        order = np.argsort(arrivals, kind="stable")  # rows in time order, whatever the file's
        prompt, output, arrivals = prompt[order], output[order], arrivals[order]
    return Trace(prompt, output, arrivals)


@cache
def trace_stats() -> dict:
    text = resources.files("fluidserve.bench").joinpath("trace_stats.json").read_text()
    return json.loads(text)


def trace_source(name: str) -> Path | None:
    root = data_dir()
    if root is None:
        return None
    path = root / "traces" / TRACE_FILES[name]
    return path if path.is_file() else None


def _interp_quantiles(q: list[float], u: np.ndarray) -> np.ndarray:
    return np.interp(u, np.linspace(0, 1, len(q)), q)


def standin_lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sample (prompt, output) from the quantile tables of trace ``name``."""
    st = trace_stats()[name]
    prompt = _interp_quantiles(st["prompt_quantiles"], rng.random(n))
    decile = np.clip(np.searchsorted(st["prompt_deciles"], prompt, side="right") - 1, 0, 9)
    u = rng.random(n)
    output = np.array([_interp_quantiles(st["output_quantiles_by_prompt_decile"][d], ui)
                       for d, ui in zip(decile, u, strict=True)])
    return np.rint(prompt), np.rint(output)


def base_lengths(spec: WorkloadSpec, name: str, n: int, rng: np.random.Generator):
    """(prompt, output, arrivals or None, source description) for a trace-like source."""
    path = Path(spec.dataset_path) if spec.dataset_path else trace_source(name)
    if path is not None:
        t = read_trace(path)
        if spec.arrivals == "trace" and t.arrivals is not None:
            idx, arr = trace_window(t.arrivals, n, rng)
        else:
            idx = rng.permutation(len(t.prompt))
            if n > len(idx):
                idx = np.concatenate([idx, rng.integers(0, len(t.prompt), n - len(idx))])
            idx, arr = idx[:n], None
        return t.prompt[idx].astype(float), t.output[idx].astype(float), arr, str(path)
    p, o = standin_lengths(name, n, rng)
    return p, o, None, f"built-in stand-in for {name} (quantiles of the public trace)"


def trace_window(arrivals: np.ndarray, n: int, rng: np.random.Generator):
    """(rows, arrival times from 0) of ``n`` consecutive requests of a time-ordered trace,
    from a seeded start: a slice keeps the trace's bursts, where a random sample of its rows
    thins them towards Poisson (the splitwise_code trace's gaps have a CV of 13; 100 rows
    sampled at random, a median of 1.9; 100 consecutive ones, 5.5). Longer than the trace:
    it is replayed again after itself, one mean gap later, as often as needed."""
    m = len(arrivals)
    if n <= m:
        start = int(rng.integers(0, m - n + 1))
        idx = np.arange(start, start + n)
        return idx, arrivals[idx] - arrivals[start]
    idx = np.arange(n) % m
    span = arrivals[-1] - arrivals[0]
    lap = span + (span / (m - 1) if m > 1 else 1.0)
    return idx, arrivals[idx] - arrivals[0] + (np.arange(n) // m) * lap


def synthetic_lengths(spec: WorkloadSpec, n: int, rng: np.random.Generator):
    if spec.dataset == "fixed":
        return np.full(n, spec.input_len, float), np.full(n, spec.output_len, float)
    if spec.dataset == "uniform":
        r = spec.range_ratio

        def uni(mean: int) -> np.ndarray:
            return rng.uniform(mean * (1 - r), mean * (1 + r), n)

        return uni(spec.input_len), uni(spec.output_len)

    def zipf(limit: int) -> np.ndarray:  # bounded Zipf over 1..limit
        k = np.arange(1, limit + 1)
        p = k ** -spec.zipf_theta
        return rng.choice(k, size=n, p=p / p.sum()).astype(float)

    return zipf(spec.max_prompt_len), zipf(spec.max_output_len)


def tetri_lengths(spec: WorkloadSpec, n: int, rng: np.random.Generator):
    wanted = [spec.dataset] * n if spec.dataset != "mixed" else [
        TETRI_CLASSES[i % 4] for i in range(n)]
    pool_p, pool_o, _, src = base_lengths(spec, spec.tetri_base, max(4 * n, 4000), rng)
    cls = np.where(pool_p >= TETRI_PROMPT_THRESHOLD, 2, 0) + np.where(
        pool_o >= TETRI_DECODE_THRESHOLD, 1, 0)
    prompt, output = np.empty(n), np.empty(n)
    for c in sorted(set(wanted)):  # sorted: set order varies between processes
        members = np.flatnonzero(cls == TETRI_CLASSES.index(c))
        if len(members) == 0:
            raise ValueError(f"the {spec.tetri_base} lengths contain no {c} requests")
        slots = [i for i, w in enumerate(wanted) if w == c]
        pick = rng.choice(members, size=len(slots))
        prompt[slots], output[slots] = pool_p[pick], pool_o[pick]
    order = rng.permutation(n)
    return prompt[order], output[order], f"TetriInfer {spec.dataset} classes from {src}"


def arrival_times(spec: WorkloadSpec, n: int, rng: np.random.Generator,
                  trace_arrivals: np.ndarray | None) -> np.ndarray:
    if spec.arrivals == "trace":
        if trace_arrivals is None:
            raise ValueError(f"dataset {spec.dataset!r} has no arrival timestamps;"
                             " use --arrivals rate")
        arr = np.asarray(trace_arrivals, float)
        if math.isfinite(spec.request_rate) and n > 1 and arr[-1] > 0:
            arr = arr * ((n - 1) / arr[-1]) / spec.request_rate  # rescale to the asked rate
        return arr
    if math.isinf(spec.request_rate):
        return np.zeros(n)
    shape = spec.burstiness
    gaps = rng.gamma(shape, 1.0 / (spec.request_rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_workload(spec: WorkloadSpec) -> tuple[list[WorkloadRequest], str]:
    """The requests of ``spec`` (same seed, same workload) and where the lengths came from."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_prompts
    trace_arr = None
    if spec.dataset in SYNTHETIC:
        (prompt, output), source = synthetic_lengths(spec, n, rng), f"synthetic {spec.dataset}"
    elif spec.dataset in (*TETRI_CLASSES, "mixed"):  # drawn from --dataset-path if given
        prompt, output, source = tetri_lengths(spec, n, rng)
    else:  # a trace: --dataset-path, or the named trace's file (or its stand-in)
        prompt, output, trace_arr, source = base_lengths(spec, spec.dataset, n, rng)
    prompt = np.clip(np.rint(prompt * spec.prompt_scale), 1, spec.max_prompt_len).astype(int)
    output = np.clip(np.rint(output * spec.output_scale), 1, spec.max_output_len).astype(int)
    arrivals = arrival_times(spec, n, rng, trace_arr)
    reqs = [WorkloadRequest(i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompt, output, strict=True))]
    return reqs, source
