"""What a tensor- or pipeline-parallel step sends to its ranks, and what building it costs:
the whole prepared inputs (``prepare_inputs``, as the ranks got them before) against what
changed (``step_delta``: the driver encodes, each rank decodes and prepares). No model: a
real scheduler plans a saturated workload (every request at once, each with the logit
rules ``--rules`` names: penalties, or allowed tokens, every other one of 32000), a fake
sampler answers, and both ways run on the same plans, alternated plan by plan.

Per plan kind (decode-only / with prefill tokens): the median bytes a rank receives, the
driver's time (build + pickle), and a rank's time (unpickle, and for the delta decode +
prepare). JSON: one line per kind, then a summary line.

    python scripts/bench_step_messages.py
    python scripts/bench_step_messages.py --requests 128 --prompt 2000 --output 512 \
        --rules repetition
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler import RunnerOutput, SchedulerLimits, make_scheduler
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.step_delta import StepDecoder, StepEncoder
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams

RULES = {
    "none": {},
    "presence": {"presence_penalty": 0.5, "frequency_penalty": 0.3},
    "repetition": {"repetition_penalty": 1.1, "presence_penalty": 0.5},
    "allowed": {"allowed_token_ids": list(range(0, 32000, 2))},
}
HIGHEST = pickle.HIGHEST_PROTOCOL


def whole(plan, block_size: int) -> tuple[bytes, float, float]:
    t0 = time.perf_counter()
    payload = pickle.dumps(prepare_inputs(plan, block_size), protocol=HIGHEST)
    t1 = time.perf_counter()
    pickle.loads(payload)
    return payload, t1 - t0, time.perf_counter() - t1


def delta(plan, block_size: int, enc: StepEncoder, dec: StepDecoder
          ) -> tuple[bytes, float, float]:
    t0 = time.perf_counter()
    payload = pickle.dumps(enc.encode(plan), protocol=HIGHEST)
    t1 = time.perf_counter()
    prepare_inputs(dec.decode(pickle.loads(payload)), block_size)
    return payload, t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens of each request")
    ap.add_argument("--output", type=int, default=256, help="output tokens of each request")
    ap.add_argument("--rules", choices=list(RULES), default="presence",
                    help="the logit rules of every request")
    ap.add_argument("--budget", type=int, default=512, help="sarathi's token budget")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    bs, n = args.block_size, args.requests
    ctx = args.prompt + args.output
    sched = make_scheduler("sarathi", SchedulerLimits(args.budget, n, ctx, 1, "fcfs"),
                           BlockManager(n * -(-ctx // bs), bs, 0.0))
    rng = random.Random(0)
    for i in range(n):
        sched.add_request(Request(f"cmpl-{i:08x}", [rng.randrange(32000)
                                                    for _ in range(args.prompt)],
                                  # (each its own, as a server's requests have)
                                  SamplingParams(max_tokens=args.output, ignore_eos=True,
                                                 **RULES[args.rules]), 0.0))
    enc, dec = StepEncoder(), StepDecoder()
    rows: dict[str, dict[str, list[float]]] = {}
    step = 0
    while sched.has_unfinished():
        plan = sched.schedule(float(step))
        kind = "decode-only" if plan.num_prefill_tokens == 0 else "with-prefill"
        r = rows.setdefault(kind, {k: [] for k in (
            "whole_bytes", "whole_driver_s", "whole_rank_s",
            "delta_bytes", "delta_driver_s", "delta_rank_s")})
        ways = [("whole", (bs,)), ("delta", (bs, enc, dec))]
        for name, extra in ways if step % 2 else ways[::-1]:  # (alternated plan by plan)
            payload, driver_s, rank_s = (whole if name == "whole" else delta)(plan, *extra)
            r[f"{name}_bytes"].append(len(payload))
            r[f"{name}_driver_s"].append(driver_s)
            r[f"{name}_rank_s"].append(rank_s)
        sampled = {c.request_id: rng.randrange(32000) for c in plan.chunks if c.samples}
        sched.update(plan, RunnerOutput(sampled, 0.0), step + 1.0)
        step += 1
    total = {}
    for kind, r in rows.items():
        line = {"kind": kind, "plans": len(r["whole_bytes"])}
        for k, v in r.items():
            line[f"median_{k}"] = statistics.median(v)
            total[k] = total.get(k, 0.0) + sum(v)
        print(json.dumps(line))
    print(json.dumps({"requests": n, "prompt": args.prompt, "output": args.output,
                      "rules": args.rules, "budget": args.budget, "plans": step,
                      "total": total,
                      "bytes_ratio": total["delta_bytes"] / total["whole_bytes"]}))


if __name__ == "__main__":
    main()
