"""Two variants of the engine timed side by side in one process, in alternated rounds (ABBA),
on the race model: the shared parts of the A/B benchmarks (bench_sampled_rows.py,
bench_huge_pages.py). Each prints one JSON line per case: both medians, their ratio (the
first variant over the second) and every run."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.model.builder import race_model_dir
from fluidserve.profiler.run import _chunk
from fluidserve.sampling_params import SamplingParams

BURST = "saturated burst offline (40 x 256/64, budget 2048)"
ENGINE_ARGS = dict(dtype="bfloat16", max_model_len=2048, kv_cache_memory_gb=1)


def main(doc: str, steps, burst) -> None:
    """A benchmark's command line (--rounds, --skip-burst): ``steps(model, rounds)``, then
    ``burst(model, rounds)``, on the race model (built if missing)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="Runs of each side per case.")
    ap.add_argument("--skip-burst", action="store_true", help="Only the steps.")
    args = ap.parse_args()
    model = str(race_model_dir())
    steps(model, args.rounds)
    if not args.skip_burst:
        burst(model, args.rounds)


def abba(rounds: int, sides: tuple[str, str]) -> list[str]:
    """a, b, b, a, ... (``rounds`` runs of each)."""
    return [sides[0] if r % 4 in (0, 3) else sides[1] for r in range(2 * rounds)]


def report(case: str, unit: str, times: dict[str, list[float]]) -> None:
    (a, ta), (b, tb) = times.items()
    ma, mb = statistics.median(ta), statistics.median(tb)
    print(json.dumps({"case": case, "unit": unit, a: round(ma, 2), b: round(mb, 2),
                      "ratio": round(ma / mb, 3), f"{a}_runs": [round(x, 2) for x in ta],
                      f"{b}_runs": [round(x, 2) for x in tb]}), flush=True)


def with_decodes(ex) -> list[ScheduledChunk]:
    """Prefill 40 requests of 300 tokens on executor ``ex``; their next decodes."""
    bs = ex.block_size
    for i in range(40):
        ex.execute(SchedulerOutput(0, [_chunk(f"r{i}", 0, 300, bs, 40 + 20 * i)]))
    return [_chunk(f"r{i}", 300, 1, bs, 40 + 20 * i) for i in range(40)]


def chunk(n: int, block_size: int, name: str = "p", base: int = 1000) -> ScheduledChunk:
    """A fresh prompt of ``n`` tokens, past the decodes' blocks."""
    return _chunk(name, 0, n, block_size, base)


def step_times_ms(ex, plan: SchedulerOutput, rounds: int) -> list[float]:
    """``rounds`` timed executions of ``plan`` on executor ``ex``, after one untimed (the same
    slots rewritten with the same values each time), in milliseconds."""
    ex.execute(plan)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        ex.execute(plan)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def time_steps(case: str, plan: SchedulerOutput, rounds: int, sides: tuple[str, str], run,
               reps: int = 1) -> None:
    """``run(side, plan)`` executes the plan on that side; each timed run is ``reps``
    executions after one untimed (the same slots rewritten with the same values)."""
    times = {s: [] for s in sides}
    for side in abba(rounds, sides):
        run(side, plan)
        t = time.perf_counter()
        for _ in range(reps):
            run(side, plan)
        times[side].append((time.perf_counter() - t) / reps * 1e3)
    report(case, "ms per step", times)


def time_burst(rounds: int, sides: tuple[str, str], generate) -> None:
    """``generate(side, prompts, params)`` runs the burst on that side."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times = {s: [] for s in sides}
    for side in abba(rounds, sides):
        prompts = [[rng.randrange(100, 30000) for _ in range(256)] for _ in range(40)]
        t = time.perf_counter()
        generate(side, prompts, params)
        times[side].append(40 * (256 + 64) / (time.perf_counter() - t))
    report(BURST, "tokens/s", times)
