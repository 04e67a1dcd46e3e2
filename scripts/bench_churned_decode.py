"""A batch of decode steps through the engine's executor on block tables left by churn.

The race model (213M bf16, GQA 16/4, 1 GiB KV cache) runs N decodes at C tokens of context
(``--decode NxC``, default 40x290) whose block tables are the ones the engine's own
BlockManager leaves after 3000 decode steps of requests arriving and finishing
(``bench_attention.churned_tables``): how a long-running server's KV cache is laid out, its
requests' blocks scattered, where a fresh engine's prompts sit in consecutive blocks. The KV
content is whatever the cache holds (the step's time does not depend on it). Prints one JSON
line: the median step over ``--rounds`` and the checkout it ran.

A kernel or engine change is judged by running this from two checkouts, alternated (ABBA),
on a machine whose speed drifts by more than the change:

    python scripts/bench_churned_decode.py
    (cd /tmp/base && PYTHONPATH=. python /tmp/base/scripts/bench_churned_decode.py)
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench_attention import churned_tables
from engine_ab import ENGINE_ARGS, step_times_ms

import fluidserve
from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
from fluidserve.model.builder import race_model_dir
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import GREEDY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", default="40x290", help="requests x context (default 40x290)")
    ap.add_argument("--rounds", type=int, default=10, help="Timed steps (after one untimed).")
    args = ap.parse_args()
    n, ctx = (int(x) for x in args.decode.split("x"))
    ex = ModelExecutor(str(race_model_dir()), **ENGINE_ARGS)
    tables = churned_tables(n, ctx, ex.num_blocks)
    plan = SchedulerOutput(0, [
        ScheduledChunk(f"r{i}", ctx - 1, (5,), tuple(t.tolist()), True, GREEDY, 0, 0,
                       is_decode=True) for i, t in enumerate(tables)])
    times = step_times_ms(ex, plan, args.rounds)
    ex.shutdown()
    adjacent = (tables[:, 1:] == tables[:, :-1] + 1).float().mean().item()
    print(json.dumps({"decode": args.decode, "checkout": str(fluidserve.__file__),
                      "blocks_after_their_predecessor": round(adjacent, 3),
                      "step_ms": round(statistics.median(times), 2),
                      "runs_ms": [round(t, 2) for t in times]}), flush=True)


if __name__ == "__main__":
    main()
