"""TetriInfer against colocated serving, in simulation at GPU scale (docs/disaggregation.md).

For each of TetriInfer's workload classes (LPLD, LPHD, HPLD, HPHD: light/heavy prefill at 512
prompt tokens, light/heavy decode at 128 output tokens; and mixed) with Poisson arrivals,
runs the same requests through:

- ``vllm x1``: one colocated instance, vLLM's prefill-first batching (TetriInfer's baseline);
- ``vllm x2`` and ``sarathi x2``: two colocated instances (requests alternate between them),
  equal hardware to the disaggregated pair -- Sarathi-Serve's stall-free batching is what
  the paper does not compare with;
- ``tetriinfer 1P+1D``: one prefill and one decode instance (fluidserve/disagg).

and reports mean TTFT, mean JCT, P99 TBT, resource time (GPUs x makespan) and perf/$
(1 / (mean JCT x resource time)), relative to ``vllm x1``. Writes JSON, markdown tables and
a plot:

    python scripts/disagg_sim.py --out docs/disaggregation.json --plot docs/img/disagg.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fluidserve.bench.workload import build_workload
from fluidserve.config import BenchConfig, EngineConfig, SimConfig

CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD", "mixed")
# Arrival rates (req/s) that load one colocated vLLM instance without overloading it
# (mistral-7b on an A100), so that latencies compare systems rather than queue growth.
RATES = {"LPLD": 8.0, "LPHD": 2.0, "HPLD": 2.0, "HPHD": 0.8, "mixed": 1.5}
SYSTEMS = ("vllm x1", "vllm x2", "sarathi x2", "tetriinfer 1P+1D")
# TetriInfer's reported gains over vLLM (paper, abstract and section 5).
PAPER = {"mixed": "TTFT -85%, JCT -50%", "LPHD": "2.4x perf/$", "HPHD": "little gain"}


def run(job: dict) -> dict:
    from fluidserve.bench.run import workload_spec
    from fluidserve.disagg.sim import simulate_disaggregated
    from fluidserve.sim.run import make_cost_model, make_executor
    from fluidserve.sim.simulate import simulate

    sim = SimConfig(model_shape=job["shape"], device=job["device"])
    bench = BenchConfig(dataset_name=job["workload"], num_prompts=job["n"],
                        request_rate=job["rate"], seed=job["seed"], max_prompt_len=8192,
                        max_output_len=4096, plots=False)
    work, _ = build_workload(workload_spec(bench))
    t0 = time.perf_counter()
    name = job["system"]
    if name.startswith("tetriinfer"):
        p, d = (int(x[:-1]) for x in name.split()[1].split("+"))
        eng = EngineConfig.create(disaggregate=True, num_prefill_instances=p,
                                  num_decode_instances=d, **job["knobs"])
        records, res = simulate_disaggregated(work, eng, sim, job["seed"])
        gpus, makespan = p + d, res.makespan
        busy = sum(i.busy for i in res.instances)
        extra = {"kv_transfer_seconds": res.transfer_seconds, "flips": len(res.flips),
                 "preemptions": sum(i.sched.num_preemptions for i in res.instances),
                 "final_roles": [i.role for i in res.instances]}
    else:
        policy, copies = name.split(" x")
        copies = int(copies)
        eng = EngineConfig.create(scheduler=policy, token_budget=512 if policy == "sarathi"
                                  else 8192)
        records, makespan, busy, preempted = [], 0.0, 0.0, 0
        for k in range(copies):
            part = work[k::copies]
            cost = make_cost_model(sim, eng.parallel)
            cost.reseed(job["seed"] + k)
            res = simulate(part, eng, make_executor(sim, eng, cost))
            records += res.records
            makespan = max(makespan, res.makespan)
            busy += sum(res.stage_busy)
            preempted += res.preemptions
        gpus, extra = copies, {"preemptions": preempted}
    ok = [r for r in records if r.error is None and r.gaps]
    ttft = statistics.fmean(r.gaps[0] for r in ok)
    jct = statistics.fmean(sum(r.gaps) for r in ok)
    tbts = sorted(g for r in ok for g in r.gaps[1:])
    p99 = tbts[int(0.99 * (len(tbts) - 1))] if tbts else 0.0
    return job | {"completed": len(ok), "requests": len(records), "ttft_s": ttft, "jct_s": jct,
                  "p99_tbt_s": p99, "gpus": gpus, "makespan_s": makespan,
                  "resource_s": gpus * makespan, "busy_s": busy,
                  "perf_per_dollar": 1 / (jct * gpus * makespan),
                  "perf_per_busy_dollar": 1 / (jct * busy),
                  "wall_s": time.perf_counter() - t0} | extra


def tables(results: list[dict]) -> str:
    out = ["| workload | rate (req/s) | system | mean TTFT (s) | mean JCT (s) | P99 TBT (s) |"
           " GPU·s held / busy | TTFT vs vllm x1 | JCT vs vllm x1 | perf/$ vs vllm x1"
           " (held / busy) | paper (TetriInfer vs vLLM) |", "|---" * 11 + "|"]
    for w in CLASSES:
        rows = {r["system"]: r for r in results if r["workload"] == w}
        base = rows.get("vllm x1")
        for s in SYSTEMS:
            r = rows.get(s)
            if r is None or base is None:
                continue
            paper = PAPER.get(w, "") if s.startswith("tetriinfer") else ""
            out.append(
                f"| {w} | {r['rate']:g} | {s} | {r['ttft_s']:.3f} | {r['jct_s']:.2f} |"
                f" {r['p99_tbt_s']:.3f} | {r['resource_s']:.0f} / {r['busy_s']:.0f} |"
                f" {r['ttft_s'] / base['ttft_s'] - 1:+.0%} |"
                f" {r['jct_s'] / base['jct_s'] - 1:+.0%} |"
                f" {r['perf_per_dollar'] / base['perf_per_dollar']:.2f}x /"
                f" {r['perf_per_busy_dollar'] / base['perf_per_busy_dollar']:.2f}x | {paper} |")
    return "\n".join(out)


def ablation_jobs(n: int, seed: int, shape: str, device: str, scale: float) -> list[dict]:
    """One knob at a time around the defaults, 2P+2D (so the dispatcher has a choice), on the
    mixed workload; flips on heavy-prefill light-decode with 1P+3D."""
    variants = [("defaults", {})]
    variants += [(f"prefill_policy={v}", {"prefill_policy": v}) for v in ("sjf", "ljf")]
    variants += [(f"dispatcher={v}", {"dispatcher": v})
                 for v in ("random", "round_robin", "least_loaded")]
    variants += [(f"decode_admission={v}", {"decode_admission": v})
                 for v in ("greedy", "reserve_static")]
    variants += [("length_predictor=oracle", {"length_predictor": "oracle"})]
    for bw in (2.5, 25.0):  # two nodes in the A100 profile; 200 Gbps (TetriInfer's low end)
        for gran in ("request", "chunk"):
            variants.append((f"{bw:g} GB/s, {gran}-level KV transfer",
                             {"kv_transfer_bandwidth_gbps": bw, "kv_transfer_granularity": gran}))
    jobs = [{"workload": "mixed", "system": "tetriinfer 2P+2D", "label": label, "knobs": k}
            for label, k in variants]
    jobs += [{"workload": "HPLD", "system": "tetriinfer 1P+3D", "label": f"flip {flip}",
              "knobs": {"instance_flip": flip, "flip_window": 1.0}} for flip in (False, True)]
    # Twice the rate of the main comparison: these deployments have twice the GPUs.
    jobs = [j | {"rate": RATES[j["workload"]] * scale * (2 if j["workload"] == "mixed" else 1),
                 "shape": shape, "device": device} for j in jobs]
    # Decode memory pressure (no GQA, and a KV cache cut to 3000 blocks = 48k tokens per
    # instance, about 8% of an A100), where admission and
    # dispatch have something to decide: heavy decodes, 1P+2D.
    jobs += [{"workload": "LPHD", "system": "tetriinfer 1P+2D", "shape": "llama-2-7b",
              "device": device, "rate": RATES["LPHD"] * scale * 3,
              "label": f"llama-2-7b, {k}={v}",
              "knobs": {k: v, "max_num_seqs": 256, "num_kv_blocks": 3000}}
             for k, vals in (("decode_admission", ("greedy", "reserve_static",
                                                   "reserve_dynamic")),
                             ("dispatcher", ("power_of_two", "random", "round_robin")),
                             ("length_predictor", ("oracle", "noisy")))
             for v in vals]
    return [j | {"n": n, "seed": seed} for j in jobs]


def ablation_table(results: list[dict]) -> str:
    out = ["| workload | system | variant | mean TTFT (s) | mean JCT (s) | P99 TBT (s) |"
           " preemptions | KV transfer (s, total) | flips | final roles |", "|---" * 10 + "|"]
    for r in results:
        roles = "".join(x[0].upper() for x in r.get("final_roles", []))
        out.append(f"| {r['workload']} ({r['rate']:g} req/s) | {r['system']} | {r['label']} |"
                   f" {r['ttft_s']:.3f} | {r['jct_s']:.2f} | {r['p99_tbt_s']:.3f} |"
                   f" {r.get('preemptions', 0)} | {r.get('kv_transfer_seconds', 0):.2f} |"
                   f" {r.get('flips', 0)} | {roles} |")
    return "\n".join(out)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    x = np.arange(len(CLASSES))
    width = 0.8 / len(SYSTEMS)
    for ax, key, label in zip(axes, ("ttft_s", "jct_s", "perf_per_dollar"),
                              ("mean TTFT", "mean JCT", "perf/$"), strict=True):
        for k, s in enumerate(SYSTEMS):
            vals = []
            for w in CLASSES:
                rows = {r["system"]: r for r in results if r["workload"] == w}
                base, r = rows.get("vllm x1"), rows.get(s)
                vals.append(r[key] / base[key] if r and base else np.nan)
            ax.bar(x + (k - (len(SYSTEMS) - 1) / 2) * width, vals, width, label=s)
        ax.set_xticks(x, CLASSES)
        ax.set_yscale("log")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{label} relative to vllm x1")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mistral-7b")
    ap.add_argument("--device", default="a100")
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--workloads", default=",".join(CLASSES))
    ap.add_argument("--rate-scale", type=float, default=1.0, help="Multiply every rate.")
    ap.add_argument("--tetri", default="", help="Extra TetriInfer knobs, e.g."
                    " 'prefill_policy=sjf,dispatcher=random'.")
    ap.add_argument("--out", default="runs/disagg.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--tables", action="store_true", help="Print the tables of --out.")
    ap.add_argument("--ablations", action="store_true",
                    help="Instead: TetriInfer's knobs one at a time (prefill policy, dispatcher,"
                    " admission, predictor, KV bandwidth and granularity, instance flip).")
    args = ap.parse_args()
    show = ablation_table if args.ablations else tables
    if args.tables:
        print(show(json.loads(Path(args.out).read_text())))
        return 0
    knobs = {}
    for kv in filter(None, args.tetri.split(",")):
        k, v = kv.split("=")
        knobs[k] = int(v) if v.isdigit() else v
    jobs = [{"workload": w, "system": s, "rate": RATES[w] * args.rate_scale, "n": args.num_prompts,
             "seed": args.seed, "shape": args.shape, "device": args.device, "knobs": knobs}
            for w in args.workloads.split(",") for s in SYSTEMS]
    if args.ablations:
        jobs = ablation_jobs(args.num_prompts, args.seed, args.shape, args.device,
                             args.rate_scale)
    results = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(run, jobs):
            results.append(r)
            print(f"[{time.perf_counter() - t0:5.0f}s] {r['workload']} {r['system']}:"
                  f" TTFT {r['ttft_s']:.3f} s, JCT {r['jct_s']:.2f} s", file=sys.stderr,
                  flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(show(results))
    if args.plot and not args.ablations:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
