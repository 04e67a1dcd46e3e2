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
from fluidserve.config import CapacityConfig, ConfigError
from fluidserve.metrics import to_json
from fluidserve.net import stop_process, wait_healthy

Probe = Callable[[float], tuple[bool, dict]]
# A probe whose completed requests per second fall below this share of the offered rate ran
# the server at its limit: what it served is the throughput the server sustains there. (A
# server that keeps up serves a little under the rate too, the last requests' latency added
# to the arrivals' span: 0.88 of it in 40-request probes at 1 req/s on a 2-core EPYC.)
SATURATED_SHARE = 0.75


def search_capacity(probe: Probe, start: float = 1.0, granularity: float = 0.025,
                    max_probes: int = 20, log: Callable[[str], None] | None = None,
                    min_rate: float | None = None) -> dict:
    """Assumes the SLO holds below some rate and fails above it.

    Doubles (or halves) from ``start`` until the SLO both holds and fails at some rate, then
    bisects until (high - low) / low < ``granularity`` or ``max_probes`` probes were made.
    Halving stops at ``min_rate`` (none by default): an SLO missed there is reported as no
    capacity (``below_min_rate``) rather than probed at ever longer runs.
    """
    floor = 0.0 if min_rate is None else min_rate
    probes: list[dict] = []

    def check(rate: float) -> bool:
        ok, summary = probe(rate)
        probes.append({"rate": rate, "ok": ok, "summary": summary})
        if log:
            served = summary.get("request_throughput")
            log(f"probe {len(probes)}: {rate:.4g} req/s -> {'meets' if ok else 'misses'} the SLO"
                + (f" (served {served:.3g} req/s)" if served is not None else ""))
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
                if rate <= floor:
                    break
                rate = max(rate / 2, floor)
        if lo > 0 and not math.isinf(hi):
            break
    while len(probes) < max_probes and lo > 0 and not math.isinf(hi) and (hi - lo) / lo > \
            granularity:
        mid = (lo + hi) / 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    below = lo == 0.0 and floor > 0 and hi <= floor
    if below and log:
        log(f"the SLO fails at the lowest rate probed ({floor:.4g} req/s, --min-rate): no"
            " capacity")
    return {"capacity_qps": lo, "upper_bound_qps": None if math.isinf(hi) else hi,
            "num_probes": len(probes), "probes": probes, "below_min_rate": below,
            "converged": lo > 0 and not math.isinf(hi) and (hi - lo) / lo <= granularity,
            **served_stats(probes)}


def served_stats(probes: list[dict]) -> dict:
    """What the probes served, beside the SLO: the most completed requests per second of any
    probe, and whether some probe saturated the server (served under SATURATED_SHARE of its
    rate), which makes that figure the throughput it sustains on this workload. A capacity
    set by a latency SLO moves with a few percent of machine speed where the metric sits on
    the bound; this figure does not."""
    served = [(qps if not math.isnan(qps) else 0.0, p["rate"]) for p in probes
              if (qps := (p.get("summary") or {}).get("request_throughput")) is not None]
    if not served:
        return {"most_served_qps": None, "saturated": None}
    return {"most_served_qps": max(qps for qps, _ in served),
            "saturated": any(qps < SATURATED_SHARE * rate for qps, rate in served)}


def curve_point(rate: float, ok: bool, value: float, summary: dict) -> dict:
    """One probe on the load-latency curve: the SLO's metric, and the requests it served."""
    return {"rate": rate, "value": value, "ok": ok,
            "served_qps": summary.get("request_throughput")}


def delay_stats(cfg: CapacityConfig, s: dict) -> tuple[str, dict]:
    """(the metric --max-scheduling-delay bounds in this run, its statistics)."""
    reported = s.get("scheduling_delay_s")
    if cfg.delay_metric == "ttft" or (cfg.delay_metric == "auto" and not reported):
        return "ttft", s["ttft_s"]
    if not reported:
        raise ValueError("--delay-metric scheduling: the server reports no scheduling delay"
                         " in its streams (fluidserve does; other engines do not): use"
                         " --delay-metric ttft")
    return "scheduling", reported


def _within(value: float | None, bound: float) -> bool:
    """A statistic over no values (NaN, or null read back from JSON: e.g. TBT when every
    output is one token) bounds nothing, so it holds; the run's completions are checked
    separately."""
    return value is None or math.isnan(value) or value <= bound


def slo_check(cfg: CapacityConfig) -> Callable[[dict], tuple[bool, float]]:
    """summary -> (SLO met, the metric plotted on the load-latency curve).

    Every kind requires that some request completed and none failed."""
    q = f"p{cfg.slo_percentile:g}"

    def check(s: dict) -> tuple[bool, float]:
        if s["num_completed"] == 0:
            return False, math.nan
        failed = s["num_failed"] > 0
        if cfg.slo == "tbt":
            p99 = s["tbt_s"]["p99"]
            delay = delay_stats(cfg, s)[1]["p50"]
            return (not failed and _within(p99, cfg.tbt_slo)
                    and delay <= cfg.max_scheduling_delay), p99
        if cfg.slo == "fluidity":
            return fluidity_slo_met(s), s["fraction_fluid_requests"]
        if cfg.slo == "ttft":
            v = s["ttft_s"][q]
            return not failed and v <= cfg.ttft_slo, v
        v = s["tpot_s"][q]
        return not failed and _within(v, cfg.tpot_slo), v

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
        self.path.write_text(to_json(self.data))


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
        except RuntimeError:  # it exited: with 2, its flags or model are bad (said once)
            self.__exit__()
            if self.proc.returncode != 2:
                raise
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
            why = next((x for x in reversed(lines) if "error:" in x), lines[-1] if lines else "")
            raise ConfigError(f"`fluidserve serve {' '.join(self.args)}` (a server to launch)"
                              f" refused to start: {why.strip()}") from None
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        self._log.close()
