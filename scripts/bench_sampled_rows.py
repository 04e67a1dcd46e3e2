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

import engine_ab
from engine_ab import ENGINE_ARGS, chunk, time_burst, time_steps, with_decodes

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.llm import LLM
from fluidserve.model import llama
from fluidserve.model.runner import ModelExecutor

SIDES = ("sampled_rows_only", "every_row")


def toggled(side: str) -> None:
    llama.SAMPLED_ROWS_ONLY = side == SIDES[0]


def steps(model: str, rounds: int) -> None:
    ex = ModelExecutor(model, **ENGINE_ARGS)
    bs, decodes = ex.block_size, with_decodes(ex)
    plans = {
        "8 x 256-token prompts": [chunk(256, bs, f"p{j}", 1000 + 20 * j) for j in range(8)],
        "512-token chunk + 40 decodes": [chunk(512, bs), *decodes],
        "128-token chunk + 40 decodes": [chunk(128, bs), *decodes],
    }
    for case, chunks in plans.items():
        time_steps(case, SchedulerOutput(0, chunks), rounds, SIDES,
                   lambda side, plan: (toggled(side), ex.execute(plan)))
    ex.shutdown()


def burst(model: str, rounds: int) -> None:
    llm = LLM(model, **ENGINE_ARGS, scheduler="sarathi", token_budget=2048)
    time_burst(rounds, SIDES, lambda side, prompts, params: (toggled(side),
                                                             llm.generate(prompts, params)))
    llm.close()


if __name__ == "__main__":
    engine_ab.main(__doc__, steps, burst)
