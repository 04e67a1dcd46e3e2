"""`--token-budget auto` priced on padded rows against priced on tokens, side by side.

Two engines on the same model in one process, both `auto`; one as it runs (on the CPU's
prepacked linears its iteration-time model prices a batch on the rows they are padded to),
the other with that pricing switched to the raw token count. Each round runs the same
prefill-heavy batch of requests on both, one after the other, after a warm-up run that
teaches both models this machine. Per round and engine: wall time, the prefill rate (prefill
tokens per second of the iterations that hold a prefill), the share of those iterations that
end on a padded size, and the P99 iteration time. Prints JSON lines, the medians last.

    python scripts/bench_auto_rows.py --model ~/.cache/fluidserve/models/race-200m-gqa-bf16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np

from fluidserve.engine.llm import LLM
from fluidserve.model.arch import read_arch
from fluidserve.model.linear import padded_rows
from fluidserve.sampling_params import SamplingParams


def workload(n: int, seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Log-normal prompt lengths (16-1500 tokens, median ~290), short outputs (8-48)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        length = min(1500, int(rng.lognormvariate(5.6, 0.8)) + 16)
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
        params.append(SamplingParams(max_tokens=rng.randrange(8, 48), ignore_eos=True,
                                     temperature=0))
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Model directory (on the CPU).")
    ap.add_argument("--tbt-slo", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engines = {}
    for name in ("padded", "tokens"):
        llm = LLM(args.model, token_budget="auto", tbt_slo=args.tbt_slo, scheduler="sarathi",
                  kv_cache_memory_gb=1.0, max_model_len=2048)
        model = llm.engine.core._budget_model
        if not llm.engine.executor.pads_rows:
            raise SystemExit("this engine does not pad rows (no oneDNN linears here)")
        if name == "tokens":
            model.token_rows = lambda n: n
        engines[name] = llm
    prompts, params = workload(args.requests, args.seed, read_arch(args.model).vocab_size)
    for llm in engines.values():
        llm.generate(prompts, params)  # warm-up: the online model learns this machine
    rows: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, llm in engines.items():
            tel = llm.engine.telemetry
            start = len(tel.iterations)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            its = list(tel.iterations)[start:]
            pre = [i for i in its if i.num_prefill_tokens]
            sizes = [i.num_prefill_tokens + i.num_decode_tokens for i in pre]
            row = {"round": r, "pricing": name, "wall_s": round(wall, 3),
                   "prefill_tok_s": round(sum(i.num_prefill_tokens for i in pre)
                                          / sum(i.duration for i in pre)),
                   "on_padded_size": round(float(np.mean([padded_rows(t) == t
                                                          for t in sizes])), 3),
                   "p99_iteration_ms": round(float(np.quantile(
                       [i.duration for i in its], 0.99)) * 1e3, 1)}
            rows[name].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({name: {k: statistics.median(x[k] for x in rs)
                             for k in ("wall_s", "prefill_tok_s", "on_padded_size",
                                       "p99_iteration_ms")}
                      for name, rs in rows.items()}))


if __name__ == "__main__":
    main()
