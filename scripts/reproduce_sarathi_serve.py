"""Reproduce the Sarathi-Serve capacity results in simulation (docs/reproduction.md).

Capacity = the largest Poisson request rate on the sharegpt trace at which P99 TBT stays
under the SLO and the median scheduling delay under 2 s, found with the same search code
as `fluidserve capacity`. Writes docs/reproduction.json; prints markdown tables.

    python scripts/reproduce_sarathi_serve.py [--num-prompts 1024] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fluidserve.bench.capacity import search_capacity, slo_check
from fluidserve.config import BenchConfig, CapacityConfig, EngineConfig, SimConfig
from fluidserve.sim.run import make_cost_model, run_once

VLLM_PREFILL_CAP = 8192  # vLLM admits whole prompts; its max_num_batched_tokens >= max_model_len


def engine(scheduler: str, budget: int, max_seqs: int = 128) -> EngineConfig:
    if scheduler in ("vllm", "orca"):
        budget = VLLM_PREFILL_CAP
    return EngineConfig(scheduler=scheduler, token_budget=budget, max_num_seqs=max_seqs,
                        max_model_len=16384)


def capacity(job: dict) -> dict:
    sim = SimConfig(model_shape=job["shape"], device=job["device"], tp=job["tp"], pp=job["pp"])
    eng = engine(job["scheduler"], job["budget"], job.get("max_seqs", 128))
    bench = BenchConfig(dataset_name="sharegpt", num_prompts=job["num_prompts"], seed=0,
                        max_prompt_len=8192, max_output_len=8192, plots=False)
    cap = CapacityConfig(slo="tbt", tbt_slo=job["slo"], max_scheduling_delay=2.0,
                         start_rate=job.get("start", 1.0), granularity=0.025, max_probes=20)
    cost = make_cost_model(sim)
    check = slo_check(cap)
    last: dict = {}

    def probe(rate: float):
        _, summary = run_once(sim, eng, bench, rate, cost)
        last[rate] = summary
        return check(summary)[0], {}

    t0 = time.perf_counter()
    res = search_capacity(probe, cap.start_rate, cap.granularity, cap.max_probes)
    at_cap = last.get(res["capacity_qps"], {})
    return job | {"capacity_qps": res["capacity_qps"], "probes": res["num_probes"],
                  "converged": res["converged"], "note": cost.note,
                  "p99_tbt_at_capacity": (at_cap.get("tbt_s") or {}).get("p99"),
                  "stage_idle_at_capacity": at_cap.get("stage_idle_fraction"),
                  "search_s": time.perf_counter() - t0}


def jobs(n: int) -> list[dict]:
    out = []
    for shape, device, tp, pp, slos in (("mistral-7b", "a100", 1, 1, (0.1, 0.5)),
                                        ("yi-34b", "a100", 2, 1, (0.2, 1.0)),
                                        ("llama-2-70b", "a40", 4, 2, (0.2, 1.0))):
        for slo, budget in zip(slos, (512, 2048), strict=True):
            for sched in ("sarathi", "vllm", "orca"):
                if pp > 1 and sched == "orca":
                    continue
                out.append({"figure": "capacity", "shape": shape, "device": device, "tp": tp,
                            "pp": pp, "slo": slo, "budget": budget, "scheduler": sched,
                            "num_prompts": n})
    for slo in (0.05, 0.1, 0.2, 0.5, 1.0):  # Figure 12: Mistral-7B on one A100
        for seqs in (32, 64, 128):
            out.append({"figure": "fig12", "shape": "mistral-7b", "device": "a100", "tp": 1,
                        "pp": 1, "slo": slo, "budget": 0, "scheduler": "vllm",
                        "max_seqs": seqs, "num_prompts": n})
        for budget in (512, 2048):
            out.append({"figure": "fig12", "shape": "mistral-7b", "device": "a100", "tp": 1,
                        "pp": 1, "slo": slo, "budget": budget, "scheduler": "sarathi",
                        "num_prompts": n})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="docs/reproduction.json")
    args = ap.parse_args()
    todo = jobs(args.num_prompts)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        results = []
        for r in pool.map(capacity, todo):
            results.append(r)
            print(f"[{time.perf_counter() - t0:6.0f}s] {r['figure']} {r['shape']} tp{r['tp']}"
                  f" pp{r['pp']} slo {r['slo']} {r['scheduler']} budget {r['budget']}"
                  f" seqs {r.get('max_seqs', 128)}: {r['capacity_qps']:.3g} req/s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
