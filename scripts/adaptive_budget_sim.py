"""--token-budget auto against fixed budgets, in simulation at GPU scale (Figure 12's envelope).

For each setup (model, GPUs, trace) and each P99-TBT SLO from strict to relaxed, the capacity
(largest Poisson rate with P99 TBT <= SLO and median scheduling delay <= 2 s) of sarathi
with fixed budgets and with ``auto``. Writes JSON and prints tables:

    python scripts/adaptive_budget_sim.py --out docs/adaptive.json
    python scripts/adaptive_budget_sim.py --out docs/adaptive.json --tables
    python scripts/adaptive_budget_sim.py --out docs/adaptive.json --auto-only  # after a change
                                                  # to auto: rerun it, keep the fixed budgets
    python scripts/adaptive_budget_sim.py --out docs/adaptive.json --only llama-2-70b
                                                  # one model's jobs, keep the others
    python scripts/adaptive_budget_sim.py --sweep yi-34b:arxiv:0.5:1.75 --margin 0.02
                                                  # budgets x seeds at one rate
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from fluidserve.bench.capacity import search_capacity, slo_check
from fluidserve.config import BenchConfig, CapacityConfig, EngineConfig, SimConfig
from fluidserve.sim.run import make_cost_model, run_once

SETUPS = [  # shape, device, tp, pp, trace, SLOs
    ("mistral-7b", "a100", 1, 1, "sharegpt", (0.05, 0.1, 0.2, 0.5, 1.0)),
    ("mistral-7b", "a100", 1, 1, "arxiv", (0.1, 0.2, 0.5, 1.0)),
    ("yi-34b", "a100", 2, 1, "sharegpt", (0.1, 0.2, 0.5, 1.0)),
    ("yi-34b", "a100", 2, 1, "arxiv", (0.2, 0.5, 1.0)),
    ("llama-2-70b", "a40", 4, 2, "sharegpt", (0.2, 0.5, 1.0)),
]
BUDGETS = ("auto", 256, 512, 1024, 2048)


def configs(job: dict, seed: int = 0) -> tuple[SimConfig, EngineConfig, BenchConfig]:
    sim = SimConfig(model_shape=job["shape"], device=job["device"])
    knobs = {"token_budget": job["budget"], "tensor_parallel_size": job["tp"],
             "pipeline_parallel_size": job["pp"]}
    if job["budget"] == "auto":
        knobs |= {"tbt_slo": job["slo"], "budget_margin": job["margin"]}
    eng = EngineConfig.create(scheduler=job.get("scheduler", "sarathi"), **knobs)
    bench = BenchConfig(dataset_name=job["trace"], num_prompts=job["num_prompts"], seed=seed,
                        max_prompt_len=8192, max_output_len=8192, plots=False,
                        tbt_deadline=job["slo"])
    return sim, eng, bench


def capacity(job: dict) -> dict:
    sim, eng, bench = configs(job)
    # tbt: P99 TBT <= SLO and median scheduling delay <= 2 s; fluidity: 99% of requests keep
    # Etalon's fluidity-index >= 0.9 with D_d = the SLO.
    cap = CapacityConfig(slo=job.get("kind", "tbt"), tbt_slo=job["slo"],
                         max_scheduling_delay=2.0, start_rate=1.0, granularity=0.05,
                         max_probes=14)
    cost = make_cost_model(sim, eng.parallel)
    check = slo_check(cap)
    res = search_capacity(lambda r: (check(run_once(sim, eng, bench, r, cost)[1])[0], {}),
                          cap.start_rate, cap.granularity, cap.max_probes)
    return job | {"capacity_qps": res["capacity_qps"], "converged": res["converged"]}


def jobs(n: int, margin: float) -> list[dict]:
    return [{"shape": s, "device": d, "tp": tp, "pp": pp, "trace": tr, "slo": slo,
             "budget": b, "num_prompts": n, "margin": margin}
            for s, d, tp, pp, tr, slos in SETUPS for slo in slos for b in BUDGETS]


FLUIDITY = [("mistral-7b", "a100", 1, 1, "sharegpt", (0.05, 0.1, 0.2)),
            ("yi-34b", "a100", 2, 1, "sharegpt", (0.1, 0.2, 0.5))]


def fluidity_jobs(n: int, margin: float) -> list[dict]:
    return [{"shape": s, "device": d, "tp": tp, "pp": pp, "trace": tr, "slo": slo,
             "budget": "auto", "num_prompts": n, "margin": margin, "kind": "fluidity",
             "scheduler": sched}
            for s, d, tp, pp, tr, slos in FLUIDITY for slo in slos
            for sched in ("sarathi", "sarathi_slack")]


def fluidity_table(results: list[dict]) -> str:
    out = ["| model | D_d = TBT SLO | sarathi auto | sarathi_slack auto | slack / plain |",
           "|---|---|---|---|---|"]
    for s, _, _, _, tr, slos in FLUIDITY:
        for slo in slos:
            cap = {r["scheduler"]: r["capacity_qps"] for r in results
                   if (r["shape"], r["slo"], r.get("kind")) == (s, slo, "fluidity")}
            a, b = cap.get("sarathi") or 0, cap.get("sarathi_slack") or 0
            out.append(f"| {s} ({tr}) | {slo} s | {a:.3g} | {b:.3g} |"
                       f" {f'{b / a:.2f}x' if a else '-'} |")
    return "\n".join(out)


def tables(results: list[dict]) -> str:
    if results and results[0].get("kind") == "fluidity":
        return fluidity_table(results)
    out = []
    for s, d, tp, pp, tr, slos in SETUPS:
        rows = [r for r in results if (r["shape"], r["trace"]) == (s, tr)]
        if not rows:
            continue
        gpus = f"{tp * pp}x {d.upper()}" + (f" TP{tp}" if tp > 1 else "") + (
            f"-PP{pp}" if pp > 1 else "")
        out += [f"**{s} on {gpus}, {tr}** (capacity, req/s)", "",
                "| P99 TBT SLO | " + " | ".join(f"budget {b}" for b in BUDGETS[1:])
                + " | best fixed | auto | auto / best fixed |", "|---" * (len(BUDGETS) + 3) + "|"]
        for slo in slos:
            cap = {r["budget"]: r["capacity_qps"] for r in rows if r["slo"] == slo}
            fixed = [cap.get(b) or 0 for b in BUDGETS[1:]]
            best = max(fixed)
            auto = cap.get("auto") or 0
            ratio = f"{auto / best:.2f}x" if best else "-"
            out.append(f"| {slo} s | " + " | ".join(f"{c:.3g}" for c in fixed)
                       + f" | {best:.3g} | **{auto:.3g}** | {ratio} |")
        out.append("")
    return "\n".join(out)


def sweep(spec: str, budgets: str, seeds: int, n: int, margin: float) -> None:
    """One setup at one rate, several budgets and workload seeds: the median scheduling delay
    and P99 TBT of each run, and the operator table's linear time per token at each fixed
    budget (the staircase that decides which budgets pass near capacity)."""
    shape, trace, slo, rate = spec.split(":")
    _, device, tp, pp, _, _ = next(x for x in SETUPS if (x[0], x[4]) == (shape, trace))
    for b in budgets.split(","):
        job = {"shape": shape, "device": device, "tp": tp, "pp": pp, "trace": trace,
               "slo": float(slo), "budget": b if b == "auto" else int(b), "num_prompts": n,
               "margin": margin}
        delays, p99s = [], []
        for seed in range(seeds):
            sim, eng, bench = configs(job, seed)
            summary = run_once(sim, eng, bench, float(rate))[1]
            delays.append(summary["scheduling_delay_s"]["p50"])
            p99s.append(summary["tbt_s"]["p99"])
        per_token = ""
        if b != "auto":  # the GPU table's linear layers, per token, at this budget
            cost = make_cost_model(SimConfig(model_shape=shape, device=device), eng.parallel)
            us = float(np.interp(int(b), cost.grid, cost.per_layer)) / int(b) * 1e6
            per_token = f" linear {us:.3f} us/token/layer"
        ok = sum(d <= 2.0 and p <= float(slo) for d, p in zip(delays, p99s, strict=True))
        print(f"budget {b:>5}: median delay " + " ".join(f"{d:5.2f}" for d in delays)
              + f" (mean {sum(delays) / len(delays):.2f} s), max P99 TBT {max(p99s):.3f} s,"
              f" {ok}/{seeds} within the SLO;{per_token}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--margin", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="runs/adaptive.json")
    ap.add_argument("--tables", action="store_true")
    ap.add_argument("--auto-only", action="store_true",
                    help="Rerun only the auto jobs; keep the other results already in --out.")
    ap.add_argument("--only", metavar="SHAPE", help="Rerun only this model shape's jobs; keep"
                    " the other results already in --out.")
    ap.add_argument("--fluidity", action="store_true",
                    help="Instead: fluidity-index capacity of sarathi_slack vs sarathi (auto).")
    ap.add_argument("--sweep", metavar="SHAPE:TRACE:SLO:RATE",
                    help="Instead: at one rate, each of --budgets over --seeds workload seeds"
                    " (e.g. yi-34b:arxiv:0.5:1.75).")
    ap.add_argument("--budgets", default="1536,1792,1920,2048,2176,2304,2560,auto")
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args()
    if args.sweep:
        sweep(args.sweep, args.budgets, args.seeds, args.num_prompts, args.margin)
        return 0
    if args.tables:
        print(tables(json.loads(Path(args.out).read_text())))
        return 0
    todo = (fluidity_jobs if args.fluidity else jobs)(args.num_prompts, args.margin)
    t0 = time.perf_counter()
    results = []
    if args.auto_only or args.only:
        def rerun(j: dict) -> bool:
            return ((not args.auto_only or j["budget"] == "auto")
                    and (not args.only or j["shape"] == args.only))

        todo = [j for j in todo if rerun(j)]
        if not todo:
            ap.error("nothing to rerun")
        results = [r for r in json.loads(Path(args.out).read_text()) if not rerun(r)]
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(capacity, todo):
            results.append(r)
            print(f"[{time.perf_counter() - t0:6.0f}s] {r['shape']} {r['trace']} slo {r['slo']}"
                  f" budget {r['budget']}: {r['capacity_qps']:.3g}", file=sys.stderr, flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    key = {(j["shape"], j["trace"], j["slo"], j["budget"], j.get("scheduler")): i
           for i, j in enumerate((fluidity_jobs if args.fluidity else jobs)(1, 0))}
    results.sort(key=lambda r: key.get((r["shape"], r["trace"], r["slo"], r["budget"],
                                        r.get("scheduler")), len(key)))
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
