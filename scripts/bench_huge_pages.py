"""The KV cache and the weights' tile copies on transparent huge pages, against 4 KB pages.

Two engines of the race model (213M bf16, GQA) in one process, one built with
``FLUIDSERVE_NO_HUGE_PAGES`` set (``host_memory.huge_page_empty`` then hands out the C
allocator's pages), timed in alternated rounds (ABBA): decode steps through
``ModelExecutor`` (1 and 40 requests at 300 tokens of context, and a 512-token chunk beside
the 40), and the saturated burst offline (``LLM.generate`` of 40 prompts of 256 random
tokens, 64 outputs each, budget 2048). Prints one JSON line per case (the medians of both and
their ratio), then the process's AnonHugePages.

    python scripts/bench_huge_pages.py
    python scripts/bench_huge_pages.py --rounds 8 --skip-burst
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from contextlib import contextmanager

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.llm import LLM
from fluidserve.model.builder import build_model_dir, cache_root
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import _chunk
from fluidserve.sampling_params import SamplingParams

SIDES = ("huge_pages", "small_pages")


@contextmanager
def pages(side: str):
    """Build with huge pages, or with the opt-out set (as the environment was before)."""
    before = os.environ.get("FLUIDSERVE_NO_HUGE_PAGES")
    if side == "small_pages":
        os.environ["FLUIDSERVE_NO_HUGE_PAGES"] = "1"
    else:
        os.environ.pop("FLUIDSERVE_NO_HUGE_PAGES", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLUIDSERVE_NO_HUGE_PAGES", None)
        else:
            os.environ["FLUIDSERVE_NO_HUGE_PAGES"] = before


def order(rounds: int) -> list[str]:
    """ABBA: huge, small, small, huge, ..."""
    return [SIDES[0] if r % 4 in (0, 3) else SIDES[1] for r in range(2 * rounds)]


def report(case: str, unit: str, times: dict[str, list[float]]) -> None:
    med = {s: statistics.median(times[s]) for s in SIDES}
    print(json.dumps({"case": case, "unit": unit, **{s: round(med[s], 2) for s in SIDES},
                      "ratio": round(med[SIDES[0]] / med[SIDES[1]], 3),
                      **{f"{s}_runs": [round(x, 2) for x in times[s]] for s in SIDES}}),
          flush=True)


def steps(model: str, rounds: int) -> None:
    executors = {}
    for side in SIDES:
        with pages(side):
            executors[side] = ModelExecutor(model, dtype="bfloat16", max_model_len=2048,
                                            kv_cache_memory_gb=1)
    bs = executors[SIDES[0]].block_size
    for ex in executors.values():
        for i in range(40):  # 40 requests with 300 tokens of context each
            ex.execute(SchedulerOutput(0, [_chunk(f"r{i}", 0, 300, bs, 40 + 20 * i)]))
    decodes = [_chunk(f"r{i}", 300, 1, bs, 40 + 20 * i) for i in range(40)]
    plans = {
        "decode, batch 1 (context 300)": decodes[:1],
        "decode, batch 40 (context 300)": decodes,
        "512-token chunk + 40 decodes": [_chunk("p", 0, 512, bs, 1000), *decodes],
    }
    for case, chunks in plans.items():
        plan, times = SchedulerOutput(0, chunks), {s: [] for s in SIDES}
        reps = 20 if len(chunks) == 1 else 3
        for side in order(rounds):
            ex = executors[side]
            ex.execute(plan)  # (the same slots rewritten with the same values)
            t = time.perf_counter()
            for _ in range(reps):
                ex.execute(plan)
            times[side].append((time.perf_counter() - t) / reps * 1e3)
        report(case, "ms per step", times)
    for ex in executors.values():
        ex.shutdown()


def burst(model: str, rounds: int) -> None:
    engines = {}
    for side in SIDES:
        with pages(side):
            engines[side] = LLM(model, dtype="bfloat16", max_model_len=2048,
                                kv_cache_memory_gb=1, scheduler="sarathi", token_budget=2048)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times = {s: [] for s in SIDES}
    for side in order(rounds):
        prompts = [[rng.randrange(100, 30000) for _ in range(256)] for _ in range(40)]
        t = time.perf_counter()
        engines[side].generate(prompts, params)
        times[side].append(40 * (256 + 64) / (time.perf_counter() - t))
    report("saturated burst offline (40 x 256/64, budget 2048)", "tokens/s", times)
    for llm in engines.values():
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="Runs of each side per case.")
    ap.add_argument("--skip-burst", action="store_true", help="Only the steps.")
    args = ap.parse_args()
    model = cache_root() / "models" / "race-200m-gqa-bf16"
    if not (model / "config.json").exists():
        build_model_dir(model, "200m-gqa", dtype="bfloat16")
    steps(str(model), args.rounds)
    if not args.skip_burst:
        burst(str(model), args.rounds)
    with open("/proc/self/smaps_rollup") as f:
        huge = next((line.split(":")[1].strip() for line in f
                     if line.startswith("AnonHugePages")), "n/a")
    print(json.dumps({"anon_huge_pages": huge}))


if __name__ == "__main__":
    main()
