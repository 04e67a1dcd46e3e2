"""`fluidserve capacity`: capacity of a running endpoint, or of fluidserve variants launched
per probe (``--launch "name=serve flags"``, repeatable, so schedulers compare in one run)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from fluidserve.bench.capacity import (
    LaunchedServer,
    ProbeCache,
    curve_point,
    delay_stats,
    search_capacity,
    slo_check,
)
from fluidserve.bench.report import write_run
from fluidserve.bench.run import Bench
from fluidserve.config import BenchConfig, CapacityConfig
from fluidserve.metrics import to_json

SUMMARY_KEYS = ("num_completed", "num_failed", "request_throughput", "ttft_s", "tbt_s",
                "tpot_s", "scheduling_delay_s", "fraction_fluid_requests")


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, sep, args = spec.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--launch expects NAME=FLAGS (e.g. 'sarathi=--scheduler sarathi'), "
                         f"got {spec!r}")
    return name.strip(), shlex.split(args)


def run_capacity(bcfg: BenchConfig, ccfg: CapacityConfig, launch: list[str]) -> int:
    out = Path(bcfg.output_dir or f"runs/capacity-{time.strftime('%Y%m%d-%H%M%S')}")
    check = slo_check(ccfg)
    cache = ProbeCache(out / "probe_cache.json")
    variants = [parse_variant(v) for v in launch] or [("endpoint", None)]
    workload_key = {k: v for k, v in dataclasses.asdict(bcfg).items()
                    if k not in ("output_dir", "plots", "label", "api_key")}
    shared_bench = None if launch else Bench(bcfg)
    if shared_bench is not None:
        shared_bench.warmup()
        if bcfg.profile_prefill:
            shared_bench.profile_prefill()
    results, curves = {}, {}

    def log(msg: str) -> None:
        print(msg, file=sys.stderr)

    for name, args in variants:
        curves[name] = []
        delay_metrics: set[str] = set()
        prefill_fit: list[dict] = []  # a launched variant's, from its first probe's server

        def probe(rate: float, name=name, args=args, delay_metrics=delay_metrics,
                  prefill_fit=prefill_fit) -> tuple[bool, dict]:
            key = json.dumps([name, args, rate, workload_key], default=str)
            summary = cache.get(key)
            if summary is None:
                log(f"{name}: probing {rate:.4g} req/s ({bcfg.num_prompts} requests, about"
                    f" {bcfg.num_prompts / rate:.0f} s of arrivals)")
                run_dir = out / name / f"rate-{rate:.4g}"
                if args is None:
                    records, summary = shared_bench.run(rate)
                else:
                    with LaunchedServer(args, run_dir / "server.log",
                                        ccfg.server_startup_timeout) as srv:
                        bench = Bench(dataclasses.replace(bcfg, base_url=srv.url), quiet=False)
                        bench.warmup()
                        if bcfg.profile_prefill and prefill_fit:
                            bench.use_prefill_fit(prefill_fit[0])
                        elif bcfg.profile_prefill:
                            bench.profile_prefill()
                            prefill_fit.append(bench.prefill_fit)
                        records, summary = bench.run(rate)
                write_run(run_dir, records, summary)
                cache.put(key, summary)
            ok, value = check(summary)
            if ccfg.slo == "tbt" and summary["num_completed"]:
                delay_metrics.add(delay_stats(ccfg, summary)[0])
            curves[name].append(curve_point(rate, ok, value, summary))
            return ok, {k: summary.get(k) for k in SUMMARY_KEYS}

        log(f"== capacity of {name}" + (f" ({' '.join(args)})" if args else f" at {bcfg.base_url}"))
        res = search_capacity(probe, ccfg.start_rate, ccfg.granularity, ccfg.max_probes, log,
                              ccfg.lowest_rate)
        res["server_args"] = args
        if delay_metrics:
            res["delay_metric"] = "/".join(sorted(delay_metrics))
            if ccfg.delay_metric == "auto" and "ttft" in delay_metrics:
                log(f"{name}: --max-scheduling-delay bounded the median TTFT (the server"
                    " reports no scheduling delay)")
        results[name] = res
        if res["upper_bound_qps"] is None:
            how = ": a lower bound, every rate probed met the SLO"
        elif res["capacity_qps"] == 0:
            how = f": the SLO was missed down to {res['upper_bound_qps']:.4g} req/s"
        elif not res["converged"]:
            how = f", not converged (it fails at {res['upper_bound_qps']:.4g} req/s)"
        else:
            how = ""
        log(f"{name}: capacity {res['capacity_qps']:.4g} req/s after {res['num_probes']} probes"
            + how)

    metric = {"tbt": "P99 TBT (s)", "fluidity": "fraction of requests with fluidity >= 0.9",
              "ttft": f"P{ccfg.slo_percentile:g} TTFT (s)",
              "tpot": f"P{ccfg.slo_percentile:g} TPOT (s)"}[ccfg.slo]
    bound = {"tbt": ccfg.tbt_slo, "fluidity": 0.99, "ttft": ccfg.ttft_slo,
             "tpot": ccfg.tpot_slo}[ccfg.slo]
    if bcfg.plots:
        from fluidserve.bench.plots import plot_capacity

        out.mkdir(parents=True, exist_ok=True)
        plot_capacity(curves, metric, out, bound)
    summary = {"slo": dataclasses.asdict(ccfg), "workload": workload_key,
               "capacity_qps": results[variants[0][0]]["capacity_qps"],
               "variants": {n: {k: v for k, v in r.items() if k != "probes"} | {
                   "curve": curves[n]} for n, r in results.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(to_json(summary | {"probes": {
        n: r["probes"] for n, r in results.items()}}, indent=1))
    log(f"wrote {out}")
    print(to_json(summary))
    return 0
