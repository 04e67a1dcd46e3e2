"""The engine's steps and the saturated burst on the race model, from whichever checkout runs it.

One process times, through the engine's executor on the race model (213M bf16, GQA 16/4, 1 GiB
KV cache): a batch-40 decode step at 300 tokens of context, a prefill step of 8 prompts x 256
tokens, and a 512-token chunk beside the 40 decodes (medians of ``--rounds`` after one
untimed); then the saturated burst offline (``LLM.generate`` of 40 x 256/64 at budget 2048,
``--bursts`` times). One JSON line, with the checkout it ran from.

A kernel or engine change that cannot live beside the old one in a process (a kernel source
is one build per checkout) is judged by running this from both checkouts, alternated (ABBA),
on a machine whose speed drifts by more than the change:

    git worktree add /tmp/base HEAD~1
    python scripts/bench_checkout_steps.py
    (cd /tmp/base && PYTHONPATH=. python scripts/bench_checkout_steps.py)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_ab import ENGINE_ARGS, chunk, step_times_ms, with_decodes

import fluidserve
from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.llm import LLM
from fluidserve.model.builder import race_model_dir
from fluidserve.model.runner import ModelExecutor
from fluidserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="Timed runs of each step.")
    ap.add_argument("--bursts", type=int, default=2, help="Timed bursts (0: none).")
    args = ap.parse_args()
    if args.rounds < 1 or args.bursts < 0:
        raise SystemExit("--rounds must be positive and --bursts not negative")
    model = str(race_model_dir())
    ex = ModelExecutor(model, **ENGINE_ARGS)
    bs = ex.block_size
    decodes = with_decodes(ex)

    def median_ms(plan: SchedulerOutput) -> float:
        return round(statistics.median(step_times_ms(ex, plan, args.rounds)), 2)

    row = {"checkout": fluidserve.__file__,
           "decode_40_ms": median_ms(SchedulerOutput(1, decodes)),
           "prefill_8x256_ms": median_ms(SchedulerOutput(2, [
               chunk(256, bs, f"p{i}", 1000 + 20 * i) for i in range(8)])),
           "chunk_512_and_40_decodes_ms": median_ms(SchedulerOutput(3, [
               chunk(512, bs, "q", 2000), *decodes]))}
    ex.shutdown()
    if args.bursts:
        llm = LLM(model, scheduler="sarathi", token_budget=2048, **ENGINE_ARGS)
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        prompts = [[rng.randrange(100, 30000) for _ in range(256)] for _ in range(40)]
        llm.generate(prompts[:4], params)  # first-use costs
        rates = []
        for _ in range(args.bursts):
            t = time.perf_counter()
            llm.generate(prompts, params)
            rates.append(round(40 * (256 + 64) / (time.perf_counter() - t), 1))
        row["burst_tokens_per_s"] = rates
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
