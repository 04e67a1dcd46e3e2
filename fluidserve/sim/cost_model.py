"""Iteration-time cost models for the simulator, picked by name.

A cost model maps a SchedulerOutput (the same object the real executor receives) to the
time each pipeline stage spends on it. ``gpu``: measured per-layer operator tables from
../shared/data/profiles plus modelled attention and communication; ``cpu``: fitted from a
`fluidserve profile` run on this machine.
"""

from __future__ import annotations

import csv
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np

from fluidserve.config import ConfigError
from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.data import data_dir
from fluidserve.sim.shapes import DEVICES, SHAPES, STAND_INS, TABLE_SHAPES, TABLES, Shape

LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add", "add")


@dataclass(frozen=True)
class PlanShape:
    """What a cost model needs of a batch: token count and attention work."""

    num_tokens: int
    prefills: tuple[tuple[int, int], ...]  # (chunk length, tokens already in the cache)
    decode_ctx: tuple[int, ...]  # context length of each decode
    num_samples: int

    @staticmethod
    def of(plan: SchedulerOutput) -> PlanShape:
        pre, dec, samples = [], [], 0
        for c in plan.chunks:
            n = len(c.token_ids)
            if n == 1:  # one-token runs share the batched decode attention
                dec.append(c.start + 1)
            else:
                pre.append((n, c.start))
            samples += c.samples
        return PlanShape(plan.num_tokens, tuple(pre), tuple(dec), samples)


class CostModel(ABC):
    """Contract: ``stage_times(plan)`` gives seconds per pipeline stage (len == pp)."""

    pp: int = 1
    note: str = ""

    @abstractmethod
    def stage_times(self, shape: PlanShape) -> list[float]: ...

    def iteration_time(self, plan: SchedulerOutput) -> float:
        return sum(self.stage_times(PlanShape.of(plan)))

    def contention(self, busy_stages: int) -> float:
        """How much slower a stage runs while ``busy_stages`` stages (itself included) compute
        at once: 1 where every stage has hardware of its own (GPUs)."""
        return 1.0

    def reseed(self, seed: int) -> None:
        """Restart the model's randomness, if it has any, so a run follows from its seed."""
        return None


# ----------------------------------------------------------------------------- GPU
@cache
def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def pick_table(shape: Shape, device: str, root: Path) -> tuple[str, str]:
    """(table, note): the shape's own table on this device, else the nearest stand-in."""
    options = [TABLES[shape.name]] if shape.name in TABLES else []
    options += [t for t in STAND_INS.get(shape.name, []) if t not in options]
    for t in options:
        if (root / "profiles" / "compute" / device / t / "mlp.csv").is_file():
            own = TABLE_SHAPES[t] == shape.name
            note = "" if own else f"{t} on {device} stands in for {shape.name} (op times scaled" \
                f" by the ratio of their FLOPs)"
            return t, note
    raise ValueError(f"no operator table on {device} for {shape.name}; tried {options}")


def _op_scale(op: str, target: Shape, source: Shape, tp: int) -> float:
    """Ratio of an operator's work (FLOPs and weight bytes) for target vs source shape."""
    def work(s: Shape) -> float:
        d = s.head_dim
        return {
            "attn_pre_proj": s.hidden * (s.heads + 2 * s.kv_heads) * d,
            "attn_post_proj": s.heads * d * s.hidden,
            "mlp_up_proj": s.hidden * s.mlp_in,
            "mlp_down_proj": s.ffn * s.hidden,
            "mlp_act": s.ffn,
            "attn_rope": (s.heads + s.kv_heads) * d,
        }.get(op, s.hidden)

    return work(target) / work(source)


class GPUCostModel(CostModel):
    def __init__(self, shape: str, device: str = "a100", tp: int = 1, pp: int = 1, *,
                 prefill_attention_efficiency: float = 0.55,
                 decode_attention_efficiency: float = 0.6,
                 overhead_s: float = 0.004, pipeline_across_nodes: bool = False) -> None:
        if shape not in SHAPES:
            raise ValueError(f"unknown model shape {shape!r}; choose from {', '.join(SHAPES)}")
        if device not in DEVICES:
            raise ValueError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
        root = data_dir()
        if root is None:
            raise ValueError("the gpu cost model needs the GPU operator profiles of"
                             " ../shared/data/profiles (set FLUIDSERVE_DATA_DIR to that data"
                             " directory), or simulate this CPU: --cost-model cpu (its profile"
                             " ships with fluidserve)")
        self.shape, self.dev, self.tp, self.pp = SHAPES[shape], DEVICES[device], tp, pp
        if self.shape.layers % pp:
            raise ValueError(f"{self.shape.layers} layers do not split into {pp} stages")
        self.table, self.note = pick_table(self.shape, device, root)
        self.pipeline_across_nodes = pipeline_across_nodes
        self.eff_p, self.eff_d, self.overhead = (prefill_attention_efficiency,
                                                 decode_attention_efficiency, overhead_s)
        self._load_linear(root / "profiles" / "compute" / device / self.table / "mlp.csv")
        self._load_network(root, device)

    def _load_linear(self, path: Path) -> None:
        rows = [r for r in _read_csv(path) if int(r["num_tensor_parallel_workers"]) == self.tp]
        if not rows:
            raise ValueError(f"{path} has no rows for tensor parallel degree {self.tp}")
        src = SHAPES[TABLE_SHAPES[self.table]]
        tokens = [int(r["num_tokens"]) for r in rows]
        per_layer = np.zeros(len(rows))
        for op in LINEAR_OPS:
            t = np.array([float(r[f"time_stats.{op}.median"]) for r in rows]) / 1e3
            per_layer += t * _op_scale(op, self.shape, src, self.tp)
        self.grid, self.per_layer = _dedup(tokens, list(per_layer))
        self.emb = _dedup(tokens, [float(r["time_stats.emb.median"]) / 1e3 for r in rows])[1]

    def _load_network(self, root: Path, device: str) -> None:
        """Tensor-parallel all-reduces among the GPUs of one node; pipeline hops between two
        GPUs of one node, or of two nodes with ``pipeline_across_nodes``. (The tables hold
        several layouts for one worker count: one node's NVLink is 10-100x faster than the
        network between nodes, so the layout is chosen, never averaged.)"""
        self.all_reduce = self.send_recv = None
        if self.tp > 1:
            kind = "pairwise" if self.tp == 2 else "node"
            self.all_reduce = self._net_table(root, device, kind, "all_reduce", self.tp,
                                              per_node=self.tp)
        if self.pp > 1:
            self.send_recv = self._net_table(root, device, "pairwise", "send_recv", 2,
                                             per_node=1 if self.pipeline_across_nodes else 2)

    def _net_table(self, root, device, kind, op, workers, per_node):
        folder = self.dev.network[kind]
        for name in (folder, DEVICES["a100"].network[kind]):
            path = root / "profiles" / "network" / name / f"{op}.csv"
            if path.is_file():
                rows = [r for r in _read_csv(path) if int(r["num_workers"]) == workers
                        and int(r["devices_per_node"]) == per_node]
                if rows:
                    if name != folder:
                        msg = f"{name} {op} stands in for {device} (not rescaled)"
                        self.note = f"{self.note}; {msg}" if self.note else msg
                    return _dedup([int(r["size"]) for r in rows],
                                  [float(r[f"time_stats.{op}.median"]) / 1e3 for r in rows])
        raise ValueError(f"no {op} profile for {workers} workers, {per_node} per node, on"
                         f" {device}")

    @staticmethod
    def _interp(grid: np.ndarray, vals: np.ndarray, x: float) -> float:
        """Linear interpolation on a strictly increasing grid (see _dedup); beyond the last
        point the time grows in proportion to the size (the large-size regime is
        throughput-bound, and noisy last segments must not extrapolate to negative times)."""
        if x <= grid[-1]:
            return float(np.interp(x, grid, vals))
        return float(vals[-1] * x / grid[-1])

    def attention_per_layer(self, s: PlanShape) -> float:
        sh, tp = self.shape, self.tp
        heads, kv = sh.heads / tp, max(1.0, sh.kv_heads / tp)
        d = sh.head_dim
        t = 0.0
        for q, start in s.prefills:
            flops = 4 * d * heads * (q * start + q * (q + 1) / 2)
            kv_bytes = 2 * (start + q) * kv * d * 2
            t += max(flops / (self.dev.peak_flops * self.eff_p),
                     kv_bytes / (self.dev.mem_bandwidth * self.eff_d)) + 5e-6
        if s.decode_ctx:
            kv_bytes = 2 * sum(s.decode_ctx) * kv * d * 2
            t += kv_bytes / (self.dev.mem_bandwidth * self.eff_d) + 5e-6
        return t

    def stage_times(self, s: PlanShape) -> list[float]:
        n = s.num_tokens
        layers = self.shape.layers // self.pp
        layer = self._interp(self.grid, self.per_layer, n) + self.attention_per_layer(s)
        if self.all_reduce is not None:  # after attention and after the MLP
            layer += 2 * self._interp(*self.all_reduce, n * self.shape.hidden * 2)
        hop = self._interp(*self.send_recv, n * self.shape.hidden * 2) if self.pp > 1 else 0.0
        times = [layers * layer + (hop if i < self.pp - 1 else 0.0) for i in range(self.pp)]
        times[0] += self.overhead + self._interp(self.grid, self.emb, n)
        v = self.shape.vocab / self.tp
        head_flops = 2 * self.shape.hidden * v * s.num_samples
        times[-1] += max(head_flops / (self.dev.peak_flops * 0.6),
                         self.shape.hidden * v * 2 / self.dev.mem_bandwidth)
        return times


def _dedup(xs: list[float], ys: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique xs with the median y of each (tables repeat a size, one row per rank or
    per run)."""
    groups: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        groups.setdefault(x, []).append(y)
    keys = sorted(groups)
    return np.array(keys, float), np.array([float(np.median(groups[k])) for k in keys])


# ----------------------------------------------------------------------------- CPU
class CPUCostModel(CostModel):
    """time = c . (1, max(0, T - k) for k in KNOTS, sum q^2, sum q x cached, sum ctx, reqs)

    T is the batch's token count, so the first terms are a convex piecewise-linear curve in
    T (flat while streaming the weights dominates, steeper once the matmuls are compute
    bound), with knots where the profile bends. Attention adds each
    multi-token chunk's work against itself (q^2) and against its cached prefix (q x
    cached), and the one-token runs' reads of their own contexts (the paged decode kernel
    reads each run's blocks in place; telemetry older than ``single_ctx_sum`` gives count x
    longest context instead); the last term is per-request engine work.

    Coefficients are non-negative and fitted to relative error, first on the points of a
    `fluidserve profile` run, then (``calibrate``) on engine telemetry of served runs, which
    prices the hybrid batches, the engine's per-request overheads and the server's
    contention for the cores as they really were. Calibration also keeps the served
    iterations' residuals (served / fitted time), grouped by whether the batch holds a
    multi-token chunk and by how many requests it holds (the variability grows with the
    streams the server feeds while it computes): with ``jitter`` set, every simulated
    iteration is scaled by a residual drawn at random from its group (``reseed``), so the
    simulated tails include the served machine's iteration-to-iteration variability.
    Stretches of iterations far slower than fitted (a machine transient, ``_transients``)
    are left out of both.
    """

    KNOTS = (0, 16, 64, 128, 256, 512, 1024, 2048)
    REQUEST_GROUPS = (3, 6, 12)  # residual groups: <3, 3-5, 6-11, >=12 requests in the batch
    MIN_GROUP = 20  # smaller groups draw from all residuals
    TRANSIENT_WINDOW = 25  # iterations whose median served/fitted time ...
    TRANSIENT_SLOWDOWN = 1.5  # ... this many times the run's marks a machine transient
    jitter = False
    residuals: dict[tuple[bool, int] | None, np.ndarray] | None = None
    _rng: np.random.Generator | None = None

    def __init__(self, profile: dict, pp: int = 1) -> None:
        # With pp stages each holds 1/pp of the layers, and all of them share the profiled
        # machine's cores (the profile's threads): each stage's process gets cores // pp
        # threads (at least one, as `fluidserve` gives its ranks), and a stage's time is 1/pp
        # of the fitted whole-model time, scaled linearly from the threads the prices were
        # measured on to the stage's. Stages computing at once beyond the cores share them
        # (``contention``). Hidden-state hops over loopback are not modelled.
        self.pp = pp
        self.cores = self.threads = max(1, int(profile.get("threads") or 1))
        self.stage_threads = max(1, self.cores // pp)
        rows, ys = [], []
        for p in profile["iteration_time"]:  # one fresh prompt of n tokens
            n = p["tokens"]
            rows.append(self.features(n, n * n if n > 1 else 0, 0, int(n == 1), 1))
            ys.append(p["time_s"])
        for p in profile["decode"]:  # b one-token runs at one context
            b = p["batch_size"]
            rows.append(self.features(b, 0, 0, b * (p["context"] + 1), b))
            ys.append(p["time_s"])
        for p in profile["chunked_prefill"]:  # a prompt in k chunks, timed in total
            c, k = p["chunk_size"], p["prompt"] // p["chunk_size"]
            rows.append(sum(self.features(c, c * c, c * c * i, 0, 1) for i in range(k)))
            ys.append(p["time_s"])
        # k fresh prompts of n tokens in one iteration: without them a single prompt's tokens
        # and its attention work grow together, the fit cannot tell them apart, and a batch of
        # short prompts was priced as one long one (8 x 256 tokens 12% over, on a 2-core Xeon).
        for p in profile.get("batched_prefill", []):
            k, n = p["prompts"], p["prompt_tokens"]
            rows.append(self.features(k * n, k * n * n, 0, 0, k))
            ys.append(p["time_s"])
        self._fit(np.array(rows), np.array(ys))
        self.note = f"cpu profile of {profile.get('model', '?')} ({profile.get('dtype', '?')})"
        if pp > 1:
            self.note += (f"; {pp} pipeline stages of 1/{pp} of the layers each, on"
                          f" {self.stage_threads} of the profile's {self.cores} threads each")

    @classmethod
    def features(cls, tokens: int, sq_work: float, prefix_work: float, single_ctx: int,
                 requests: int) -> np.ndarray:
        hinges = [max(0, tokens - k) for k in cls.KNOTS]
        return np.array([1.0, *hinges, sq_work, prefix_work, single_ctx, requests], float)

    def _fit(self, x: np.ndarray, y: np.ndarray) -> None:
        """Non-negative least squares on relative error (columns scaled for conditioning)."""
        from scipy.optimize import nnls

        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(x / y[:, None] / scale, np.ones_like(y))
        self.coef = coef / scale

    def calibrate(self, runs: list[list[dict]], threads: int | None = None) -> int:
        """Refit on engine telemetry (one list of iteration records per served run); the
        target is the time from one iteration's start to the next one's. ``threads``: what the
        served runs computed on (default: the profile's, as `fluidserve serve` does)."""
        if threads is not None:
            self.threads = threads
        rows, ys, groups, run_of = [], [], [], []
        for run, (a, b) in ((r, p) for r, its in enumerate(runs)
                            for p in zip(its, its[1:], strict=False)):
            gap = b["start"] - a["start"]
            if gap > 1.5 * a["duration"] + 0.02:  # the engine idled in between: not a target
                continue
            pre, npre = a["num_prefill_tokens"], a["num_prefill_requests"]
            # Older telemetry lacks sum q^2: one prompt per prefill request is the estimate.
            sq = a.get("sq_work", pre * pre / npre if npre else 0)
            ctx = a.get("single_ctx_sum", a.get("num_single", 0) * a.get("single_ctx_max", 0))
            rows.append(self.features(pre + a["num_decode_tokens"], sq, a.get("prefix_work", 0),
                                      ctx, a["num_requests"]))
            ys.append(gap)
            groups.append(self._group(a["num_requests"] > a.get("num_single", 0),
                                      a["num_requests"]))
            run_of.append(run)
        need = 2 * len(self.coef)
        if len(rows) < need:
            raise ValueError(f"calibration needs at least {need} busy iterations, got {len(rows)}")
        x, y = np.array(rows), np.array(ys)
        self._fit(x, y)
        # A stretch of consecutive iterations all far slower than their fitted price is the
        # machine (another tenant, a frequency drop), not the engine: drawn at random into a
        # simulation it slows every part of the run, and in the mean it raised every price
        # (one such stretch, 10% of a Zen 4 run's iterations at 1.5-13x, priced the next
        # run's iterations 17-22% high). Such stretches are left out and the rest refit.
        slow = self._transients(y / (x @ self.coef), np.array(run_of))
        if (~slow).sum() < need:  # too little left to fit: a slow machine, not a transient
            slow[:] = False
        if slow.any():
            x, y = x[~slow], y[~slow]
            groups = [g for g, s in zip(groups, slow, strict=True) if not s]
            self._fit(x, y)
        ratio = y / (x @ self.coef)
        self.coef *= ratio.mean()  # the fit is to relative error; keep the mean time unbiased
        ratio /= ratio.mean()
        self.residuals = {None: ratio}
        for g in set(groups):
            member = ratio[np.array([h == g for h in groups])]
            if len(member) >= self.MIN_GROUP:
                self.residuals[g] = member
        p10, p90 = np.percentile(ratio, [10, 90])
        self.note += (f"; calibrated on {len(y)} served iterations (served/fitted time:"
                      f" p10 {p10:.2f}, p90 {p90:.2f})")
        if slow.any():
            self.note += (f"; left out {int(slow.sum())} iterations in stretches"
                          f" {self.TRANSIENT_SLOWDOWN}x slower than fitted (over"
                          f" {self.TRANSIENT_WINDOW} iterations)")
        return len(y)

    @classmethod
    def _transients(cls, ratio: np.ndarray, run_of: np.ndarray) -> np.ndarray:
        """Which iterations lie in a machine transient: where the median served/fitted ratio
        of the TRANSIENT_WINDOW consecutive iterations around one is TRANSIENT_SLOWDOWN times
        its run's median or more. A single slow iteration is the engine's own variability and
        stays (the jitter replays it); so do runs slow throughout (their median moves)."""
        from scipy.ndimage import median_filter

        out = np.zeros(len(ratio), bool)
        for run in np.unique(run_of):
            sel = run_of == run
            r = ratio[sel]
            rolling = median_filter(r, size=cls.TRANSIENT_WINDOW, mode="reflect")
            out[sel] = rolling >= cls.TRANSIENT_SLOWDOWN * np.median(r)
        return out

    def reseed(self, seed: int) -> None:
        use = self.jitter and self.residuals is not None
        self._rng = np.random.default_rng(seed) if use else None

    def stage_times(self, s: PlanShape) -> list[float]:
        f = self.features(s.num_tokens, sum(q * q for q, _ in s.prefills),
                          sum(q * start for q, start in s.prefills), sum(s.decode_ctx),
                          len(s.prefills) + len(s.decode_ctx))
        t = float(self.coef @ f)
        if self._rng is not None:
            g = self._group(bool(s.prefills), len(s.prefills) + len(s.decode_ctx))
            pool = self.residuals.get(g, self.residuals[None])
            t *= pool[self._rng.integers(len(pool))]
        return [t / self.pp * self.threads / self.stage_threads] * self.pp

    def contention(self, busy_stages: int) -> float:
        return max(1.0, busy_stages * self.stage_threads / self.cores)

    @classmethod
    def _group(cls, has_chunk: bool, requests: int) -> tuple[bool, int]:
        return has_chunk, int(np.searchsorted(cls.REQUEST_GROUPS, requests, side="right"))


def read_telemetry(paths: list[str]) -> list[list[dict]]:
    """Iteration records of each telemetry JSONL file (one list per file, in order)."""
    out = []
    for p in paths:
        try:
            with open(p) as f:
                records = [json.loads(line) for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"--cpu-calibration {p}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--cpu-calibration {p}: not JSON lines ({e})") from None
        its = [r for r in records if isinstance(r, dict) and r.get("type") == "iteration"]
        for i, r in enumerate(its):
            if why := _bad_point(r, ITERATION_FIELDS, "duration"):
                raise ConfigError(f"--cpu-calibration {p}: iteration record {i} {why} (not"
                                  f" engine telemetry of `fluidserve serve --telemetry-file`?)")
        out.append(its)
    return out


def _bad_point(point, fields: tuple[str, ...], time_field: str) -> str | None:
    """Why a profile point or telemetry record cannot be fitted, or None."""
    if not isinstance(point, dict):
        return "is not an object"
    for f in fields:
        v = point.get(f)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v < 0:
            return f"has no {f} (a finite number >= 0)"
    if not point[time_field] > 0:
        return f"has {time_field} {point[time_field]} (must be > 0)"
    return None


PROFILE_KEYS = ("iteration_time", "decode", "chunked_prefill")
PROFILE_FIELDS = {"iteration_time": ("tokens", "time_s"),
                  "decode": ("batch_size", "context", "time_s"),
                  "chunked_prefill": ("chunk_size", "prompt", "time_s"),
                  "batched_prefill": ("prompts", "prompt_tokens", "time_s")}
ITERATION_FIELDS = ("start", "duration", "num_prefill_tokens", "num_prefill_requests",
                    "num_decode_tokens", "num_requests")
# The shipped `fluidserve profile` results (the 250M benchmark model in bf16, 2 threads), by
# the CPU they were taken on: the engine runs other kernels on other instruction sets, and
# one CPU's prices are far off another's (the EPYC's priced served runs on the Xeon's at
# 2.4-2.6x their median TTFT, docs/simulator.md).
SHIPPED_CPU_PROFILES = {
    "epyc-zen3": "cpu_profile_250m_bf16.json",  # 2-core AMD EPYC (Zen 3): the AVX2 panels
    "epyc-zen4": "cpu_profile_250m_bf16_zen4.json",  # 2-core AMD EPYC (Zen 4): dot panels
    "xeon-emr": "cpu_profile_250m_bf16_avx512.json",  # 2-core Xeon, AVX-512 without AMX
    "xeon-amx": "cpu_profile_250m_bf16_amx.json",  # 2-core Xeon with AMX: tiles and oneDNN
}


def nearest_cpu_profile(flags: str | None = None, vendor: str | None = None) -> str:
    """The shipped profile nearest this CPU (or one with these instruction-set ``flags`` and
    ``vendor`` id): xeon-amx where the CPU has AMX (the tile kernels and oneDNN's AMX
    matmuls); where the engine runs its AVX-512 panels (AVX-512 without AMX), epyc-zen4 on an
    AMD CPU with AVX-512 BF16 (whose bf16 dot product issues as fast as its FMA: the
    dot-product panels), else xeon-emr (the FMA panels); elsewhere epyc-zen3 (the AVX2
    panels; also the stand-in for CPUs no profile was taken on)."""
    from fluidserve.kernels import cpu_flags, cpu_vendor

    f = set((cpu_flags() if flags is None else flags).split())
    if {"amx_tile", "amx_bf16", "avx512f", "avx512bw"} <= f:
        return "xeon-amx"
    if {"avx512f", "avx512bw"} <= f:
        amd = (cpu_vendor() if vendor is None else vendor) == "AuthenticAMD"
        return "epyc-zen4" if amd and "avx512_bf16" in f else "xeon-emr"
    return "epyc-zen3"


def load_cpu_profile(path: str | None) -> dict:
    """A `fluidserve profile` result: ``path``'s, a shipped one by name
    (``SHIPPED_CPU_PROFILES``), or with no path the shipped one nearest this CPU."""
    name = path or nearest_cpu_profile()
    if name in SHIPPED_CPU_PROFILES:
        text = resources.files("fluidserve.sim").joinpath(SHIPPED_CPU_PROFILES[name])
        return json.loads(text.read_text())
    try:
        profile = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--cpu-profile {path}: {e.strerror or e} (a profile.json, or one"
                          f" of the shipped: {', '.join(SHIPPED_CPU_PROFILES)})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--cpu-profile {path}: not JSON ({e})") from None
    missing = [k for k in PROFILE_KEYS if not isinstance(profile, dict) or k not in profile]
    if missing:
        raise ConfigError(f"--cpu-profile {path}: not a `fluidserve profile` result (no"
                          f" {', '.join(missing)})")
    points = 0
    for key, fields in PROFILE_FIELDS.items():
        entries = profile.get(key, [])
        if not isinstance(entries, list):
            raise ConfigError(f"--cpu-profile {path}: {key} is not a list")
        for i, point in enumerate(entries):
            if why := _bad_point(point, fields, "time_s"):
                raise ConfigError(f"--cpu-profile {path}: {key}[{i}] {why}")
        points += len(entries)
    need = len(CPUCostModel.features(1, 0, 0, 0, 1))
    if points < need:
        raise ConfigError(f"--cpu-profile {path}: {points} timed points; the fit needs at"
                          f" least {need}")
    return profile
