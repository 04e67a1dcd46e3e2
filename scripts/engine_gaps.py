"""Token gaps through the engine core, synchronous against asynchronous scheduling.

A benchmark program, not a test. Requests of ``--context`` prompt tokens decode ``--tokens``
each through ``EngineCore`` (no HTTP) on one loaded model, the two ways in interleaved rounds:
synchronous (the host applies a step's tokens, schedules and builds the next step while the
device waits) and ``--async-scheduling`` (the next step is launched first, its decodes reading
the tokens in flight on the device). Prints and writes JSON: the median gap between a
request's tokens each way, and their ratio. ``scripts/bench_cuda.py`` runs the same on a GPU
with the decode steps replayed from CUDA graphs.

    python scripts/engine_gaps.py --model DIR [--device cpu] [--batches 1,8] --out gaps.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from fluidserve.model.runner import ModelExecutor
from fluidserve.sampling_params import SamplingParams


def engine_gaps(ex: ModelExecutor, model: str, graphs: dict, last: torch.Tensor, batch: int,
                ctx: int, tokens: int, rounds: int) -> dict:
    """Median gap (ms) between the tokens of ``batch`` requests of ``ctx`` prompt tokens
    decoding ``tokens`` each through the engine core (and the median time to their first
    token), synchronous (``graphs["sync"]``) and with asynchronous scheduling
    (``graphs["async"]``, captured by bench_cuda's ``capture_async``; none: eager steps), in
    interleaved rounds on the same executor. ``last``: the sampled-token buffer the async
    graphs read."""
    from concurrent.futures import ThreadPoolExecutor

    from fluidserve.config import EngineConfig
    from fluidserve.engine.core import EngineCore
    from fluidserve.engine.messages import AddRequest

    waiter = ThreadPoolExecutor(1) if ex.device.type == "cuda" else None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = [100 + i % 1000 for i in range(ctx)]
    gaps: dict[str, list[float]] = {"sync": [], "async": []}
    ttft: dict[str, list[float]] = {"sync": [], "async": []}
    try:
        for _ in range(rounds):
            for name, runs in gaps.items():
                on = name == "async"
                ex.worker.graphs = graphs.get(name)
                ex.worker.last_tokens = last if on else None
                ex.resolves_placeholders, ex._waiter = on, waiter if on else None
                cfg = EngineConfig.create(model=model, device=ex.device.type,
                                          async_scheduling=on, token_budget=2048,
                                          max_num_seqs=max(batch, 8))
                core = EngineCore(cfg, ex)
                for i in range(batch):
                    core.add(AddRequest(f"{name}{i}", prompt, params, None))
                seen, first = [], []
                while core.has_unfinished():
                    for d in core.step().outputs:
                        if d.tbt is not None:
                            seen.append(d.tbt)
                        if d.ttft is not None:
                            first.append(d.ttft)
                runs.append(statistics.median(seen) * 1e3)
                ttft[name].append(statistics.median(first) * 1e3)
    finally:
        ex.worker.last_tokens, ex.resolves_placeholders, ex._waiter = None, False, None
        if waiter is not None:
            waiter.shutdown()
    out = {f"{k}_gap_ms": statistics.median(v) for k, v in gaps.items()}
    out |= {f"{k}_ttft_ms": statistics.median(v) for k, v in ttft.items()}
    return {"batch": batch, "context": ctx, "tokens": tokens, **out,
            "async_over_sync": out["async_gap_ms"] / out["sync_gap_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Model directory.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,8", help="Requests decoding together.")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="JSON file to write.")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ex = ModelExecutor(args.model, dtype=args.dtype, device=args.device,
                       kv_cache_memory_gb=1.0, max_num_seqs=max(batches + [8]))
    last = torch.zeros(256, dtype=torch.int32, device=ex.device)
    engine_gaps(ex, args.model, {}, last, 1, args.context, 8, 1)  # warm-up (kernel builds)
    rows = []
    for b in batches:
        rows.append(engine_gaps(ex, args.model, {}, last, b, args.context, args.tokens,
                                args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    result = {"cpu": cpu, "device": args.device, "torch": torch.__version__,
              "model": args.model, "threads": torch.get_num_threads(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
