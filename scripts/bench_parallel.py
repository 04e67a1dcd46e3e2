"""Pipeline and tensor parallelism on this machine: throughput, and pipeline bubbles measured
beside the simulator's prediction. A benchmark program (JSON on stdout; --doc rewrites the
measured part of the doc, up to its "Reading the numbers").

    python scripts/bench_parallel.py --out runs/parallel --doc docs/parallelism.md

(a) Throughput: the same saturated workload (all requests at once) through one process with
    two threads, -pp 2 and -tp 2 (one thread per rank), output and total tokens/s.
(b) Bubbles: a Poisson workload replayed on the wall clock against -pp 2 with sarathi and with
    vllm scheduling; each stage's idle fraction = 1 - busy / wall, from the ranks' own clocks.
    Prediction: the CPU cost model calibrated on the same workload run in one process with one
    thread (the time of every layer on one core), split into two stages of half the layers,
    simulated with the same scheduler and arrivals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from fluidserve.bench.workload import WorkloadSpec, build_workload
from fluidserve.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.sampling_params import SamplingParams

BUDGETS = {"sarathi": 256, "vllm": 2048}


def log(msg: str) -> None:
    print(f"[parallel {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompt_ids(n: int, i: int) -> list[int]:
    return [10 + (i * 7 + k) % 1000 for k in range(n)]


def replay(engine: LLMEngine, work, wall_clock: bool) -> float:
    """Add each request at its arrival time (or all at once) and run to completion."""
    pending = sorted(work, key=lambda w: w.arrival)
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and (not wall_clock or pending[0].arrival <= now):
            w = pending.pop(0)
            engine.add_request(str(w.index), prompt_ids(w.prompt_len, w.index),
                               SamplingParams(max_tokens=w.output_len, temperature=0.0,
                                              ignore_eos=True))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0].arrival - (time.monotonic() - t0)))
    return time.monotonic() - t0


def throughput(model: str, args) -> list[dict]:
    work, _ = build_workload(WorkloadSpec(dataset="fixed", num_prompts=args.saturated_n,
                                          input_len=256, output_len=64, seed=0))
    rows = []
    for label, knobs in [("1 process, 2 threads", {"num_threads": 2}),
                         ("-pp 2 (1 thread/rank)", {"pipeline_parallel_size": 2}),
                         ("-tp 2 (1 thread/rank)", {"tensor_parallel_size": 2})]:
        cfg = EngineConfig.create(model=model, dtype="bfloat16", token_budget=512,
                                  max_model_len=1024, kv_cache_memory_gb=1.0, **knobs)
        log(f"throughput: {label}")
        engine = LLMEngine(cfg)
        replay(engine, work[:4], wall_clock=False)  # warm-up
        wall = replay(engine, work, wall_clock=False)
        engine.shutdown()
        out = sum(w.output_len for w in work)
        rows.append({"config": label, "wall_s": wall, "output_tokens_per_s": out / wall,
                     "total_tokens_per_s": (out + sum(w.prompt_len for w in work)) / wall})
    return rows


def bubbles(model: str, args) -> list[dict]:
    from fluidserve.config import SimConfig
    from fluidserve.sim.cost_model import CPUCostModel, load_cpu_profile, read_telemetry
    from fluidserve.sim.simulate import CostModelExecutor, simulate

    spec = WorkloadSpec(dataset="sharegpt", num_prompts=args.poisson_n, prompt_scale=0.25,
                        output_scale=0.1, max_prompt_len=1024, max_output_len=128,
                        request_rate=args.rate, seed=0)
    work, source = build_workload(spec)
    rows = []
    for policy, budget in BUDGETS.items():
        common = dict(model=model, dtype="bfloat16", scheduler=policy, token_budget=budget,
                      max_model_len=2048, kv_cache_memory_gb=1.0)
        log(f"bubbles: {policy}, one process, one thread (calibration)")
        one = LLMEngine(EngineConfig.create(num_threads=1, **common))
        replay(one, work, wall_clock=True)
        tele = Path(tempfile.mkdtemp()) / "one.jsonl"
        one.telemetry.export_jsonl(tele)
        log(f"bubbles: {policy}, -pp 2")
        cfg = EngineConfig.create(pipeline_parallel_size=2, **common)
        pp = LLMEngine(cfg)
        before = pp.executor.stats()
        wall = replay(pp, work, wall_clock=True)
        after = pp.executor.stats()
        pp.shutdown()
        measured = [1 - (a["busy_s"] - b["busy_s"]) / wall for a, b in zip(after, before,
                                                                           strict=True)]
        cost = CPUCostModel(load_cpu_profile(SimConfig().cpu_profile), pp=2)
        cost.calibrate(read_telemetry([str(tele)]), threads=1)  # the run above's
        ex = CostModelExecutor(cost, pp.executor.num_blocks, 16, 2048)
        sim = simulate(work, cfg, ex)
        rows.append({"scheduler": policy, "token_budget": budget, "workload": source,
                     "request_rate": args.rate, "wall_s": wall,
                     "stage_idle_measured": measured,
                     "stage_idle_simulated": sim.stage_idle_fraction,
                     "makespan_simulated_s": sim.makespan})
    return rows


def report(res: dict, command: str) -> str:
    t = res["throughput"]
    base = t[0]["output_tokens_per_s"]
    lines = ["# Parallelism: pipeline and tensor parallelism across processes", "",
             f"Measured {res['started']} on {res['cpu']} ({os.cpu_count()} cores) with the",
             "213M bf16 GQA model (`fluidserve build-model --shape 200m-gqa`). Command:", "",
             f"    {command}", "", "## Throughput (saturated: "
             f"{res['saturated_n']} requests of 256/64 tokens at once, sarathi budget 512)", "",
             "| configuration | output tok/s | total tok/s | vs one process |", "|---|---|---|---|"]
    for r in t:
        lines.append(f"| {r['config']} | {r['output_tokens_per_s']:.1f} |"
                     f" {r['total_tokens_per_s']:.1f} | {r['output_tokens_per_s'] / base:.2f}x |")
    lines += ["", f"## Pipeline bubbles, -pp 2 ({res['poisson_n']} requests, Poisson"
              f" {res['rate']} req/s)", "",
              "| scheduler | stage idle, measured | stage idle, simulated |", "|---|---|---|"]
    for r in res["bubbles"]:
        m = " / ".join(f"{x:.0%}" for x in r["stage_idle_measured"])
        s = " / ".join(f"{x:.0%}" for x in r["stage_idle_simulated"])
        lines.append(f"| {r['scheduler']} (budget {r['token_budget']}) | {m} | {s} |")
    by = {r["scheduler"]: r for r in res["bubbles"]}
    if {"sarathi", "vllm"} <= set(by):
        def mean(r, k):
            return sum(r[k]) / len(r[k])

        sm, vm = mean(by["sarathi"], "stage_idle_measured"), mean(by["vllm"], "stage_idle_measured")
        ss, vs = (mean(by["sarathi"], "stage_idle_simulated"),
                  mean(by["vllm"], "stage_idle_simulated"))
        lines += ["", f"At this load the stages idle {sm:.0%} of the time on average with sarathi"
                  f" and {vm:.0%} with vllm ({vm - sm:+.0%} for vllm); the simulator predicts"
                  f" {ss:.0%} and {vs:.0%} ({vs - ss:+.0%}). The cost model splits the layers'"
                  " time evenly between the stages; the last stage also runs the LM head and"
                  " sampling."]
    return "\n".join(lines)


MEASURED_END = "## Reading the numbers"  # what --doc replaces: the doc up to this heading


def write_doc(path: Path, measured: str) -> None:
    """Replace the measured part of ``path`` (all before ``MEASURED_END``), keeping its
    prose; a doc without that heading gets the measured part on top."""
    old = path.read_text() if path.exists() else ""
    at = old.find(MEASURED_END)
    path.write_text(measured + "\n\n" + (old[at:] if at >= 0 else old))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/parallel")
    ap.add_argument("--doc", default=None)
    ap.add_argument("--saturated-n", type=int, default=32)
    ap.add_argument("--poisson-n", type=int, default=60)
    ap.add_argument("--rate", type=float, default=0.5)
    args = ap.parse_args()
    from fluidserve.model.builder import cached_model_dir

    model = str(cached_model_dir("200m-gqa", "bfloat16"))
    info = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in
                                                 open("/proc/cpuinfo").read().split("\n\n")[0]
                                                 .splitlines())}
    cpu = f"{info.get('model name', '?')}, family {info.get('cpu family', '?')} model" \
        f" {info.get('model', '?')}"
    res = {"started": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "model": model,
           "saturated_n": args.saturated_n, "poisson_n": args.poisson_n, "rate": args.rate}
    res["throughput"] = throughput(model, args)
    res["bubbles"] = bubbles(model, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.json").write_text(json.dumps(res, indent=1))
    if args.doc:
        write_doc(Path(args.doc), report(res, "python scripts/bench_parallel.py "
                                         + " ".join(sys.argv[1:])))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
