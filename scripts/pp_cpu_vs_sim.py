"""Pipeline stages on this CPU, served and simulated side by side: one JSON line per row.

For each pipeline size, the same two workloads through the offline engine (``LLM``, the
250M bf16 model, sarathi at budget 512, each rank on the machine's threads // pp) and
through the simulator's cpu cost model (``--cpu-profile``, default the one of this CPU's
kind): a burst of 32 prompts of 256 tokens with 32 output tokens each, and one request of
256/64. The figure is the time until the last request ends.

    python scripts/pp_cpu_vs_sim.py --sizes 1,2,4
"""

from __future__ import annotations

import argparse
import json
import random
import time

from fluidserve.bench.workload import WorkloadSpec, build_workload
from fluidserve.config import EngineConfig, SimConfig
from fluidserve.engine.llm import LLM
from fluidserve.model.builder import cached_model_dir
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.run import make_cost_model, make_executor
from fluidserve.sim.simulate import simulate

WORKLOADS = {"burst": (32, 256, 32), "one request": (1, 256, 64)}


def served(model: str, pp: int, n: int, prompt: int, out: int) -> float:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 30000) for _ in range(prompt)] for _ in range(n)]
    params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)
    with LLM(model, pipeline_parallel_size=pp, token_budget=512) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        t = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t


def simulated(profile: str | None, pp: int, n: int, prompt: int, out: int) -> float:
    sim = SimConfig(cost_model="cpu", cpu_profile=profile)
    eng = EngineConfig.create(pipeline_parallel_size=pp, token_budget=512)
    work, _ = build_workload(WorkloadSpec(dataset="fixed", num_prompts=n, input_len=prompt,
                                          output_len=out, seed=0))
    ex = make_executor(sim, eng, make_cost_model(sim, eng.parallel))
    return simulate(work, eng, ex).makespan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,4", help="Pipeline sizes, comma-separated.")
    ap.add_argument("--cpu-profile", default=None, help="As `fluidserve simulate`'s.")
    args = ap.parse_args()
    model = str(cached_model_dir("250m", "bfloat16"))
    for name, (n, prompt, out) in WORKLOADS.items():
        for pp in (int(s) for s in args.sizes.split(",")):
            print(json.dumps({"workload": name, "requests": n, "prompt": prompt, "output": out,
                              "pp": pp, "served_s": served(model, pp, n, prompt, out),
                              "simulated_s": simulated(args.cpu_profile, pp, n, prompt, out)}),
                  flush=True)


if __name__ == "__main__":
    main()
