"""`fluidserve simulate`: one workload, a capacity search, or a token budget, in simulation."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from fluidserve.bench.capacity import curve_point, search_capacity, slo_check
from fluidserve.bench.report import constant_deadline, score_fluidity, summarize_run, write_run
from fluidserve.bench.workload import build_workload
from fluidserve.config import BenchConfig, CapacityConfig, EngineConfig, ParallelConfig, SimConfig
from fluidserve.config.commands import profiled_shape
from fluidserve.core.admission import cache_blocks
from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.core.token_budget import find_token_budget, pass_target
from fluidserve.metrics import to_json
from fluidserve.model.arch import kv_bytes_per_token
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.cost_model import (
    CostModel,
    CPUCostModel,
    GPUCostModel,
    load_cpu_profile,
    read_telemetry,
)
from fluidserve.sim.shapes import DEVICES, SHAPES
from fluidserve.sim.simulate import CostModelExecutor, gpu_kv_blocks, simulate

# The EngineConfig sections the simulator uses (no model is loaded).
SIM_SECTIONS = ("cache", "scheduler", "parallel", "disagg")
WORKLOAD_FIELDS = {"dataset_name", "dataset_path", "num_prompts", "input_len", "output_len",
                   "range_ratio", "prompt_scale", "output_scale", "max_prompt_len",
                   "max_output_len", "shared_prefix_len", "request_rate", "burstiness",
                   "arrivals", "seed",
                   "ttft_deadline", "tbt_deadline", "output_dir", "plots", "label"}
SIM_MAX_MODEL_LEN = 16384


def make_cost_model(sim: SimConfig, par: ParallelConfig) -> CostModel:
    if sim.pipeline_across_nodes and (sim.cost_model == "cpu"
                                      or par.pipeline_parallel_size == 1):
        raise ValueError("--pipeline-across-nodes places GPU pipeline stages on nodes of their"
                         " own: it needs --cost-model gpu and --pipeline-parallel-size > 1")
    if sim.cost_model == "cpu":
        if par.tensor_parallel_size != 1:
            raise ValueError("the cpu cost model has no tensor parallelism")
        model = CPUCostModel(load_cpu_profile(sim.cpu_profile), par.pipeline_parallel_size)
        if sim.cpu_calibration:
            model.calibrate(read_telemetry(sim.cpu_calibration.split(",")))
            model.jitter = sim.cpu_jitter
        return model
    return GPUCostModel(sim.model_shape, sim.device, par.tensor_parallel_size,
                        par.pipeline_parallel_size,
                        pipeline_across_nodes=sim.pipeline_across_nodes)


def make_executor(sim: SimConfig, eng: EngineConfig, cost: CostModel) -> CostModelExecutor:
    c, par = eng.cache, eng.parallel
    blocks = c.num_kv_blocks
    if blocks is None and sim.cost_model == "gpu":
        blocks = gpu_kv_blocks(SHAPES[sim.model_shape], DEVICES[sim.device],
                               par.tensor_parallel_size, par.pipeline_parallel_size,
                               c.block_size, sim.gpu_memory_utilization)
    if blocks is None:  # cpu: what `fluidserve serve` allots the profiled model by default
        m = profiled_shape()
        per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads,
                                       m.hidden_size // m.num_heads, 2, 1,
                                       par.pipeline_parallel_size)
        blocks = cache_blocks(per_token, c.block_size, c.kv_cache_memory_gb,
                              eng.scheduler.max_num_seqs, sim.context_window(), c.watermark)
    return CostModelExecutor(cost, blocks, c.block_size, sim.context_window())


def reference_batch(budget: int, decodes: int, context: int) -> SchedulerOutput:
    """A full stall-free batch: ``decodes`` decodes plus one prefill chunk filling the budget."""
    p = SamplingParams()
    d = min(decodes, budget)
    chunks = [ScheduledChunk(str(i), context, (0,), (), True, p, 0, 0, True) for i in range(d)]
    if budget > d:
        chunks.append(ScheduledChunk("p", context, (0,) * (budget - d), (), False, p, 0, 0))
    return SchedulerOutput(0, chunks)


def run_once(sim: SimConfig, eng: EngineConfig, bench: BenchConfig, rate: float | None = None,
             cost: CostModel | None = None) -> tuple[list, dict]:
    from fluidserve.bench.run import workload_spec

    cost = cost or make_cost_model(sim, eng.parallel)
    spec = workload_spec(bench, **({"request_rate": rate} if rate is not None else {}))
    work, source = build_workload(spec)
    jitter_seed = spec.seed if sim.cpu_jitter_seed is None else sim.cpu_jitter_seed
    t0 = time.perf_counter()
    if eng.disagg.disaggregate:
        return _run_disaggregated(work, source, spec, sim, eng, bench, t0, jitter_seed)
    ex = make_executor(sim, eng, cost)
    cost.reseed(jitter_seed)
    res = simulate(work, eng, ex, bench.shared_prefix_len)
    score_fluidity(res.records, constant_deadline(bench.ttft_deadline), bench.tbt_deadline)
    summary = summarize_run(res.records, bench.tbt_deadline)
    summary |= {
        "label": bench.label, "simulated": True, "request_rate": spec.request_rate,
        "lengths": source, "cost_model": sim.cost_model, "cost_model_note": cost.note,
        **_what_is_simulated(sim),
        "tp": eng.parallel.tensor_parallel_size,
        "pp": eng.parallel.pipeline_parallel_size, "scheduler": eng.scheduler.policy,
        "token_budget": eng.scheduler.token_budget,
        "max_num_seqs": eng.scheduler.max_num_seqs, "kv_blocks": ex.num_blocks,
        "block_size": eng.cache.block_size, "iterations": res.num_iterations,
        "preemptions": res.preemptions, "makespan_s": res.makespan,
        "shared_prefix_len": bench.shared_prefix_len,
        "prefix_cache_hit_rate": res.prefix_cache_hit_rate,
        "stage_idle_fraction": res.stage_idle_fraction,
        "simulation_wall_s": time.perf_counter() - t0,
    }
    return res.records, summary


def _run_disaggregated(work, source, spec, sim, eng, bench, t0, jitter_seed
                       ) -> tuple[list, dict]:
    from fluidserve.disagg.sim import cluster_summary, simulate_disaggregated

    records, res = simulate_disaggregated(work, eng, sim, spec.seed, jitter_seed)
    score_fluidity(records, constant_deadline(bench.ttft_deadline), bench.tbt_deadline)
    summary = summarize_run(records, bench.tbt_deadline)
    summary |= {
        "label": bench.label, "simulated": True, "request_rate": spec.request_rate,
        "lengths": source, "cost_model": sim.cost_model, **_what_is_simulated(sim),
        "tp": eng.parallel.tensor_parallel_size, "pp": eng.parallel.pipeline_parallel_size,
        "scheduler": "tetriinfer", "makespan_s": res.makespan,
        "simulation_wall_s": time.perf_counter() - t0,
    } | cluster_summary(res, eng)
    return records, summary


def run_simulate(sim: SimConfig, eng: EngineConfig, bench: BenchConfig, cap: CapacityConfig
                 ) -> int:
    cost = make_cost_model(sim, eng.parallel)
    if cost.note:
        print(f"note: {cost.note}", file=sys.stderr)
    if sim.find_token_budget:
        return _token_budget(sim, eng, cap, cost)
    out = Path(bench.output_dir or f"runs/sim-{time.strftime('%Y%m%d-%H%M%S')}")
    if sim.capacity:
        return _capacity(sim, eng, bench, cap, cost, out)
    records, summary = run_once(sim, eng, bench, cost=cost)
    write_run(out, records, summary)
    if bench.plots:
        from fluidserve.bench.plots import plot_run

        plot_run(records, summary, out, bench.label or f"simulated {eng.scheduler.policy}")
    print(f"wrote {out}", file=sys.stderr)
    print(to_json(summary))
    return 0


def _token_budget(sim: SimConfig, eng: EngineConfig, cap: CapacityConfig, cost: CostModel) -> int:
    def batch_time(b: int) -> float:
        return cost.iteration_time(reference_batch(b, sim.budget_decodes,
                                                   sim.reference_context()))

    target = pass_target(cap.tbt_slo, eng.parallel.pipeline_parallel_size)
    decodes_only = batch_time(sim.budget_decodes)
    if decodes_only > target:
        budget, t = 0, decodes_only
        msg = (f"{sim.budget_decodes} decodes at context {sim.reference_context()} alone take"
               f" {decodes_only:.3g} s > the {cap.tbt_slo} s SLO: no budget meets it; lower"
               " --budget-decodes / --budget-context or relax --tbt-slo")
        print(f"error: {msg}", file=sys.stderr)
    else:
        tile = eng.scheduler.tile_size
        budget, t = find_token_budget(batch_time, target, tile, sim.max_budget)
        msg = None
        if budget == 0:  # the decodes fit, a tile beside them does not
            msg = (f"a batch of one tile ({tile} tokens) takes {t:.3g} s > the {target:.3g} s"
                   f" a pass may take for the {cap.tbt_slo} s SLO: no budget meets it; lower"
                   " --tile-size or relax --tbt-slo")
            print(f"error: {msg}", file=sys.stderr)
    result = {"token_budget": budget, "iteration_time_s": t, "tbt_slo_s": cap.tbt_slo,
              "pass_target_s": target,
              "error": msg, "tile_size": eng.scheduler.tile_size,
              "reference_batch": {"decodes": sim.budget_decodes,
                                  "context": sim.reference_context()},
              "cost_model": sim.cost_model, "note": cost.note}
    print(to_json(result))
    return 0 if msg is None else 1


def _what_is_simulated(sim: SimConfig) -> dict:
    if sim.cost_model == "gpu":
        return {"model_shape": sim.model_shape, "device": sim.device,
                "pipeline_across_nodes": sim.pipeline_across_nodes}
    return {"model_shape": None, "device": "this cpu"}  # the profiled model, as profiled


def _capacity(sim, eng, bench, cap, cost, out: Path) -> int:
    check = slo_check(cap)
    curve = []

    def probe(rate: float) -> tuple[bool, dict]:
        records, summary = run_once(sim, eng, bench, rate, cost)
        write_run(out / f"rate-{rate:.4g}", records, summary)
        ok, value = check(summary)
        curve.append(curve_point(rate, ok, value, summary))
        return ok, {k: summary[k] for k in ("tbt_s", "ttft_s", "scheduling_delay_s",
                                             "fraction_fluid_requests", "stage_idle_fraction",
                                             "request_throughput")
                    if k in summary}  # (a disaggregated cluster has no pipeline stages)

    res = search_capacity(probe, cap.start_rate, cap.granularity, cap.max_probes,
                          lambda m: print(m, file=sys.stderr), cap.min_rate)
    summary = {"capacity_qps": res["capacity_qps"], "upper_bound_qps": res["upper_bound_qps"],
               "num_probes": res["num_probes"], "converged": res["converged"],
               "most_served_qps": res["most_served_qps"], "saturated": res["saturated"],
               "slo": dataclasses.asdict(cap),
               **({"scheduler": "tetriinfer", "token_budget": None}
                  if eng.disagg.disaggregate else
                  {"scheduler": eng.scheduler.policy, "token_budget": eng.scheduler.token_budget}),
               "cost_model": sim.cost_model,
               **_what_is_simulated(sim),
               "tp": eng.parallel.tensor_parallel_size,
               "pp": eng.parallel.pipeline_parallel_size,
               "note": cost.note, "curve": curve}
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(to_json(summary | {"probes": res["probes"]}, indent=1))
    if bench.plots:
        from fluidserve.bench.plots import plot_capacity

        plot_capacity({eng.scheduler.policy: curve}, "P99 TBT (s)" if cap.slo == "tbt" else cap.slo,
                      out, cap.tbt_slo if cap.slo == "tbt" else None)
    print(to_json(summary))
    return 0
