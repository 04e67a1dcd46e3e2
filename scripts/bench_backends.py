"""The compiled fast path against the eager fallback, side by side in one run.

Offline step times of the race model (213M bf16, GQA) through ModelExecutor with
(attention, linear) backends native/auto (the default: tile copies where the CPU has a tile
kernel), native/packed, eager/packed and eager/eager, measured in two interleaved rounds (the
median over both): a 512-token prefill, and a decode at batch 1 and at batch 40 (context
300). Prints JSON. A pair may name the panels' product (``--panel-product``) as a third part.

    python scripts/bench_backends.py
    python scripts/bench_backends.py --pairs native/auto,native/packed,eager/eager --rounds 1
    python scripts/bench_backends.py --pairs native/auto/fma,native/auto/dot,native/packed
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.model.builder import race_model_dir
from fluidserve.model.runner import ModelExecutor
from fluidserve.profiler.run import _chunk

PAIRS = (("native", "auto"), ("native", "packed"), ("eager", "packed"), ("eager", "eager"))


def median_ms(ex: ModelExecutor, plan: SchedulerOutput, n: int) -> float:
    for _ in range(2):
        ex.execute(plan)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ex.execute(plan)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(model: str, attention: str, linear: str, product: str = "auto") -> dict[str, float]:
    ex = ModelExecutor(model, dtype="bfloat16", max_model_len=2048, kv_cache_memory_gb=1,
                       attention_backend=attention, linear_backend=linear,
                       panel_product=product)
    bs = ex.block_size
    for i in range(40):  # 40 requests with 300 tokens of context each
        ex.execute(SchedulerOutput(0, [_chunk(f"r{i}", 0, 300, bs, 40 + 20 * i)]))
    decodes = [_chunk(f"r{i}", 300, 1, bs, 40 + 20 * i) for i in range(40)]
    return {"prefill512_ms": median_ms(ex, SchedulerOutput(0, [_chunk("p", 0, 512, bs, 0)]), 5),
            "decode1_ms": median_ms(ex, SchedulerOutput(0, decodes[:1]), 10),
            "decode40_ms": median_ms(ex, SchedulerOutput(0, decodes), 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default=",".join(f"{a}/{b}" for a, b in PAIRS),
                    help="ATTENTION/LINEAR[/PANEL_PRODUCT] backends, comma-separated.")
    ap.add_argument("--rounds", type=int, default=2, help="Interleaved rounds.")
    args = ap.parse_args()
    pairs = [tuple(p.split("/")) for p in args.pairs.split(",")]
    if any(len(p) not in (2, 3) for p in pairs):
        ap.error("--pairs: ATTENTION/LINEAR[/PANEL_PRODUCT],...")
    model = race_model_dir()
    runs: dict[str, list[dict]] = {"/".join(p): [] for p in pairs}
    for _ in range(args.rounds):  # interleaved rounds: drift hits every pair alike
        for p in pairs:
            runs["/".join(p)].append(measure(str(model), *p))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    out = {"cpu": cpu, "steps_ms": {pair: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                                   for pair, rs in runs.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
