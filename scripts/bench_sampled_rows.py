"""The last decoder layer for the sampled rows only, against every row, side by side.

``llama.SAMPLED_ROWS_ONLY`` toggled in one process on the race model (213M bf16, GQA), in
alternated rounds (ABBA): steps through ``ModelExecutor`` (8 prompts of 256 tokens; a
512-token and a 128-token chunk beside 40 decodes at context 300), and the saturated burst
offline (``LLM.generate`` of 40 prompts of 256 random tokens, 64 outputs each, budget 2048).
Prints one JSON line per case: the medians of both and their ratio.

    python scripts/bench_sampled_rows.py
    python scripts/bench_sampled_rows.py --rounds 8 --skip-burst
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.llm import LLM
from fluidserve.model import llama
from fluidserve.model.builder import build_model_dir, cache_root
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import _chunk
from fluidserve.sampling_params import SamplingParams


def flags(rounds: int) -> list[bool]:
    """ABBA order: True, False, False, True, ..."""
    return [r % 4 in (0, 3) for r in range(2 * rounds)]


def report(case: str, unit: str, times: dict[bool, list[float]]) -> None:
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(json.dumps({"case": case, "unit": unit, "every_row": round(off, 1),
                      "sampled_rows_only": round(on, 1), "ratio": round(on / off, 3),
                      "every_row_runs": [round(x, 1) for x in times[False]],
                      "sampled_rows_only_runs": [round(x, 1) for x in times[True]]}), flush=True)


def steps(model: str, rounds: int) -> None:
    ex = ModelExecutor(model, dtype="bfloat16", max_model_len=2048, kv_cache_memory_gb=1)
    bs = ex.block_size
    for i in range(40):  # 40 requests with 300 tokens of context each
        ex.execute(SchedulerOutput(0, [_chunk(f"r{i}", 0, 300, bs, 40 + 20 * i)]))
    decodes = [_chunk(f"r{i}", 300, 1, bs, 40 + 20 * i) for i in range(40)]
    plans = {
        "8 x 256-token prompts": [_chunk(f"p{j}", 0, 256, bs, 1000 + 20 * j) for j in range(8)],
        "512-token chunk + 40 decodes": [_chunk("p", 0, 512, bs, 1000), *decodes],
        "128-token chunk + 40 decodes": [_chunk("p", 0, 128, bs, 1000), *decodes],
    }
    for case, chunks in plans.items():
        plan, times = SchedulerOutput(0, chunks), {True: [], False: []}
        for flag in flags(rounds):
            llama.SAMPLED_ROWS_ONLY = flag
            ex.execute(plan)  # (the same slots rewritten with the same values)
            t = time.perf_counter()
            ex.execute(plan)
            times[flag].append((time.perf_counter() - t) * 1e3)
        report(case, "ms", times)
    ex.shutdown()


def burst(model: str, rounds: int) -> None:
    llm = LLM(model, dtype="bfloat16", max_model_len=2048, kv_cache_memory_gb=1,
              scheduler="sarathi", token_budget=2048)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    times = {True: [], False: []}
    for flag in flags(rounds):
        prompts = [[rng.randrange(100, 30000) for _ in range(256)] for _ in range(40)]
        llama.SAMPLED_ROWS_ONLY = flag
        t = time.perf_counter()
        llm.generate(prompts, params)
        times[flag].append(40 * (256 + 64) / (time.perf_counter() - t))
    report("saturated burst offline (40 x 256/64, budget 2048)", "tokens/s", times)
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


if __name__ == "__main__":
    main()
