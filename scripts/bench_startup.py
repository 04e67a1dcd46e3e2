"""How long `fluidserve serve` takes to answer, and what its processes hold. A benchmark.

For each checkout (``--pythonpath``: this one, ``.``, and any other, e.g. a worktree of an older
commit), alternated round by round so that drift hits all alike: start `fluidserve serve`,
time from process start to the first ``/health`` 200 and to the end of a first completion,
then read the resident memory of the front end and of the engine core. Prints one JSON line
per run and a summary (medians per checkout) as the last line.

    python scripts/bench_startup.py --rounds 3
    git worktree add /tmp/before <commit>
    python scripts/bench_startup.py --pythonpath . /tmp/before --rounds 3
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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def one_run(pythonpath: str, args) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port),
           "--num-threads", str(args.num_threads), "--served-model-name", "m"]
    if args.model:
        cmd += ["--model", args.model]
    root = str(Path(pythonpath).resolve())
    env = dict(os.environ, PYTHONPATH=root)
    t0 = time.monotonic()
    # Run in the checkout: ``python -m`` puts the working directory first on sys.path.
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 600, proc, poll=0.05)
        healthy = time.monotonic() - t0
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": "The river", "max_tokens": 8})
        r.raise_for_status()
        first = time.monotonic() - t0
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        core = [int(k) for k in kids  # not the resource tracker
                if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
        return {"pythonpath": pythonpath, "healthy_s": round(healthy, 2),
                "first_completion_s": round(first, 2), "front_end_rss_mb": rss_mb(proc.pid),
                "engine_core_rss_mb": sum(rss_mb(k) for k in core)}
    finally:
        stop_process(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", nargs="+", default=["."],
                    help="Checkouts to run the server from (alternated).")
    ap.add_argument("--model", help="Model directory (default: the embedded model).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {p: [] for p in args.pythonpath}
    for i in range(args.rounds):
        for p in args.pythonpath:
            row = one_run(p, args) | {"round": i}
            runs[p].append(row)
            print(json.dumps(row), flush=True)
    summary = {p: {k: statistics.median(r[k] for r in rows) for k in
                   ("healthy_s", "first_completion_s", "front_end_rss_mb", "engine_core_rss_mb")}
               for p, rows in runs.items()}
    print(json.dumps({"summary": summary, "rounds": args.rounds, "model": args.model}))


if __name__ == "__main__":
    main()
