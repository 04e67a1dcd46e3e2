"""How long the front end's event loop stalls while large request bodies are parsed: a
benchmark (JSON lines), the parse on a worker thread against `BodyParser`'s parse in a
process of its own.

The body is a one-token prompt beside an ignored field of 500,000 small JSON objects (4 MB,
under the default --max-request-bytes): the costliest bytes to parse. A task on the loop
sleeps 2 ms at a time while 8 such bodies are parsed one after another; its largest and
99th-percentile gaps are the loop's stalls.

    python scripts/body_parse_lag.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from fluidserve.serve.inputs import BodyParser, parse_body
from fluidserve.serve.protocol import Limits

BODY = b'{"prompt":"a","max_tokens":1,"x":[' + b",".join([b'{"a":1}'] * 500_000) + b"]}"


async def lag(read, bodies: int) -> dict:
    gaps, stop = [], False

    async def tick() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    t0 = time.perf_counter()
    for _ in range(bodies):
        await read()
    took = time.perf_counter() - t0
    stop = True
    await ticker
    gaps.sort()
    return {"parse_s": round(took / bodies, 3), "max_loop_gap_ms": round(gaps[-1] * 1e3, 1),
            "p99_loop_gap_ms": round(gaps[int(0.99 * len(gaps))] * 1e3, 1)}


async def main(rounds: int, bodies: int) -> None:
    parser = BodyParser(Limits(1024, 32000, 1024 * 20))
    model = parser.models["completion"]
    try:
        await parser.read(BODY, "completion")  # start the parser process
        for rnd in range(rounds):
            thread = await lag(lambda: asyncio.to_thread(parse_body, BODY, model), bodies)
            process = await lag(lambda: parser.read(BODY, "completion"), bodies)
            print(json.dumps({"round": rnd, "body_bytes": len(BODY), "thread": thread,
                              "process": process}), flush=True)
    finally:
        parser.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bodies", type=int, default=8, help="Bodies parsed per measurement.")
    args = ap.parse_args()
    asyncio.run(main(args.rounds, args.bodies))
