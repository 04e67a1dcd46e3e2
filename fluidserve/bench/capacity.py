"""Capacity: the largest request rate at which an SLO holds, by expansion then bisection.

The search only sees a ``probe(rate) -> (slo_met, summary)`` function, so the same code
searches a running endpoint, a fluidserve server launched per probe, or the simulator.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fluidserve.bench.report import fluidity_slo_met
from fluidserve.config import CapacityConfig
from fluidserve.net import stop_process, wait_healthy

Probe = Callable[[float], tuple[bool, dict]]


def search_capacity(probe: Probe, start: float = 1.0, granularity: float = 0.025,
                    max_probes: int = 20, log: Callable[[str], None] | None = None) -> dict:
    """Assumes the SLO holds below some rate and fails above it.

    Doubles (or halves) from ``start`` until the SLO both holds and fails at some rate, then
    bisects until (high - low) / low < ``granularity`` or ``max_probes`` probes were made.
    """
    probes: list[dict] = []

    def check(rate: float) -> bool:
        ok, summary = probe(rate)
        probes.append({"rate": rate, "ok": ok, "summary": summary})
        if log:
            log(f"probe {len(probes)}: {rate:.4g} req/s -> {'meets' if ok else 'misses'} the SLO")
        return ok

    lo, hi = 0.0, math.inf
    rate = start
    while len(probes) < max_probes and (lo == 0.0 or math.isinf(hi)):
        if check(rate):
            lo = rate
            if math.isinf(hi):
                rate *= 2
        else:
            hi = rate
            if lo == 0.0:
                rate /= 2
        if lo > 0 and not math.isinf(hi):
            break
    while len(probes) < max_probes and lo > 0 and not math.isinf(hi) and (hi - lo) / lo > \
            granularity:
        mid = (lo + hi) / 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return {"capacity_qps": lo, "upper_bound_qps": None if math.isinf(hi) else hi,
            "num_probes": len(probes), "probes": probes,
            "converged": lo > 0 and not math.isinf(hi) and (hi - lo) / lo <= granularity}


def slo_check(cfg: CapacityConfig) -> Callable[[dict], tuple[bool, float]]:
    """summary -> (SLO met, the metric plotted on the load-latency curve)."""
    q = f"p{cfg.slo_percentile:g}"

    def pct(stats: dict) -> float:
        if q in stats:
            return stats[q]
        raise ValueError(f"summaries carry p50/p90/p99; --slo-percentile {cfg.slo_percentile:g}"
                         " is not one of them")

    def check(s: dict) -> tuple[bool, float]:
        if s["num_completed"] == 0:
            return False, math.nan
        failed = s["num_failed"] > 0
        if cfg.slo == "tbt":
            p99 = s["tbt_s"]["p99"]
            delay = (s.get("scheduling_delay_s") or s["ttft_s"])["p50"]
            return (not failed and p99 <= cfg.tbt_slo and delay <= cfg.max_scheduling_delay), p99
        if cfg.slo == "fluidity":
            return fluidity_slo_met(s), s["fraction_fluid_requests"]
        if cfg.slo == "ttft":
            v = pct(s["ttft_s"])
            return not failed and v <= cfg.ttft_slo, v
        v = pct(s["tpot_s"])
        return not failed and v <= cfg.tpot_slo, v

    return check


class ProbeCache:
    """Probe summaries on disk, keyed by what determines them, so reruns skip done probes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {}

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, summary: dict) -> None:
        self.data[key] = summary
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, default=float))


class LaunchedServer:
    """`fluidserve serve <args>` on a free localhost port, for one probe."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout: float) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.timeout = startup_timeout

    def __enter__(self) -> LaunchedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})
        try:
            wait_healthy(self.url, self.timeout, self.proc, f"server (log: {self.log_path})")
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        self._log.close()
