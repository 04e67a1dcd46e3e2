"""The KV cache and the weights' tile copies on transparent huge pages, against 4 KB pages.

Two engines of the race model (213M bf16, GQA) in one process, one built with
``FLUIDSERVE_NO_HUGE_PAGES`` set (``host_memory.huge_page_empty`` then hands out the C
allocator's pages), timed in alternated rounds (ABBA): decode steps through
``ModelExecutor`` (1 and 40 requests at 300 tokens of context, and a 512-token chunk beside
the 40), and the saturated burst offline (``LLM.generate`` of 40 prompts of 256 random
tokens, 64 outputs each, budget 2048). Prints one JSON line per case (the medians of both and
their ratio), then the process's AnonHugePages while both engines are up.

    python scripts/bench_huge_pages.py
    python scripts/bench_huge_pages.py --rounds 8 --skip-burst
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import engine_ab
from engine_ab import ENGINE_ARGS, chunk, time_burst, time_steps, with_decodes

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.llm import LLM
from fluidserve.model.runner import ModelExecutor

SIDES = ("huge_pages", "small_pages")
OPT_OUT = "FLUIDSERVE_NO_HUGE_PAGES"


@contextmanager
def pages(side: str):
    """Build with huge pages, or with the opt-out set (the environment restored after)."""
    before = os.environ.pop(OPT_OUT, None)
    if side == "small_pages":
        os.environ[OPT_OUT] = "1"
    try:
        yield
    finally:
        os.environ.pop(OPT_OUT, None)
        if before is not None:
            os.environ[OPT_OUT] = before


def anon_huge_pages() -> str:
    with open("/proc/self/smaps_rollup") as f:
        return next((line.split(":")[1].strip() for line in f
                     if line.startswith("AnonHugePages")), "n/a")


def steps(model: str, rounds: int) -> None:
    executors = {}
    for side in SIDES:
        with pages(side):
            executors[side] = ModelExecutor(model, **ENGINE_ARGS)
    for ex in executors.values():
        decodes = with_decodes(ex)  # (the same chunks on both: the same blocks of each cache)
    bs = executors[SIDES[0]].block_size
    plans = {
        "decode, batch 1 (context 300)": decodes[:1],
        "decode, batch 40 (context 300)": decodes,
        "512-token chunk + 40 decodes": [chunk(512, bs), *decodes],
    }
    print(json.dumps({"anon_huge_pages": anon_huge_pages()}), flush=True)
    for case, chunks in plans.items():
        time_steps(case, SchedulerOutput(0, chunks), rounds, SIDES,
                   lambda side, plan: executors[side].execute(plan),
                   reps=20 if len(chunks) == 1 else 3)
    for ex in executors.values():
        ex.shutdown()


def burst(model: str, rounds: int) -> None:
    engines = {}
    for side in SIDES:
        with pages(side):
            engines[side] = LLM(model, **ENGINE_ARGS, scheduler="sarathi", token_budget=2048)
    time_burst(rounds, SIDES, lambda side, prompts, params: engines[side].generate(prompts,
                                                                                  params))
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    engine_ab.main(__doc__, steps, burst)
