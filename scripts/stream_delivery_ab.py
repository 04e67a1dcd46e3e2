"""How soon streamed tokens reach a client, from two checkouts side by side: a benchmark.

Serves the embedded default model (tokens ~2 ms apart on a CPU, where any delay in sending
them shows) with `fluidserve serve` from each checkout in turn, ``--rounds`` times, and
streams ``--requests`` completions of 32 prompt ids / 16 tokens at concurrency 1 (after one
warm-up): the mean time to the first token's event and the median and largest gap between
events, one JSON line per server and round.

    git worktree add /tmp/base <commit>
    python scripts/stream_delivery_ab.py --base /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fluidserve.net import free_port, stop_process, wait_healthy


def serve(checkout: str):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=checkout)
    proc = subprocess.Popen([sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port),
                             "--num-threads", "1"], env=env, cwd=checkout,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300, proc)
    return proc, url


def measure(url: str, requests: int) -> dict:
    ttft, gaps = [], []
    with httpx.Client(timeout=60) as c:
        for i in range(requests + 1):
            body = {"prompt": [10 + i + k for k in range(32)], "max_tokens": 16,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            t0, times = time.perf_counter(), []
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                times += [time.perf_counter() for line in r.iter_lines()
                          if line.startswith("data: {")]
            if i:  # (the first is a warm-up)
                ttft.append(times[0] - t0)
                gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return {"mean_ttft_ms": round(statistics.mean(ttft) * 1e3, 2),
            "median_gap_ms": round(statistics.median(gaps) * 1e3, 2),
            "max_gap_ms": round(max(gaps) * 1e3, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="The other checkout (a git worktree).")
    ap.add_argument("--rounds", type=int, default=2, help="Rounds, each serving both.")
    ap.add_argument("--requests", type=int, default=6, help="Timed streams per server.")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    for rnd in range(args.rounds):
        for label, checkout in (("base", args.base), ("this checkout", here)):
            proc, url = serve(checkout)
            try:
                print(json.dumps({"round": rnd, "server": label, "checkout": checkout,
                                  **measure(url, args.requests)}), flush=True)
            finally:
                stop_process(proc)


if __name__ == "__main__":
    main()
