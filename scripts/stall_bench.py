"""Does one client's huge prompt stall another client's stream? A benchmark, not a test.

For each server configuration (``--limits``: values of ``--max-request-bytes``, or ``none`` for
a server without that flag), it starts ``fluidserve serve``, then streams ``--tokens`` tokens
twice: alone (the baseline), and while another process sends a ``--prompt-mb`` MB prompt every
``--interval`` seconds. It reports, per configuration, the stream's time between tokens
(median, P99, largest gap) in both runs, what the big prompts got (status, latency), and the
server's resident memory (front end + engine core) before and after. The last line is JSON.

    python scripts/stall_bench.py                                  # embedded model
    python scripts/stall_bench.py --model ~/.cache/fluidserve/models/fluidserve-200m-gqa-bfloat16-*

``--pythonpath DIR`` runs the server from another checkout (say, the code before a change,
with ``--limits none``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fluidserve.net import free_port, stop_process, wait_healthy


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children, MB."""
    total = 0.0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return round(total, 1)


def start_server(args, limit: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port),
           "--num-threads", str(args.num_threads), "--served-model-name", "m"]
    if args.model:
        cmd += ["--model", args.model]
    if limit != "none":
        cmd += ["--max-request-bytes", limit]
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, proc)
    return proc, url


def stream_gaps(url: str, tokens: int, started=None) -> list[float]:
    """Arrival times of each token's chunk at the client -> gaps between them (s)."""
    body = {"prompt": "The river rose slowly in the spring", "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if started is not None and len(times) == 3:
                    started.set()
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def big_payload(megabytes: float, kind: str) -> str:
    """A body of about this size: one long prompt, or (``objects``) a one-token prompt beside an
    ignored field of small JSON objects, the costliest bytes to parse."""
    if kind == "objects":
        return json.dumps({"prompt": "a", "max_tokens": 1,
                           "x": [{"a": 1}] * int(megabytes * 1e6 / 10)})
    return json.dumps({"prompt": "word " * int(megabytes * 1e6 / 5), "max_tokens": 1})


def send_big(url: str, megabytes: float, kind: str, interval: float, started, stop,
             out) -> None:
    """In a process of its own: once the stream flows, send a big prompt every ``interval``
    seconds (or as soon as the last one is answered, if that is later) until told to stop."""
    payload = big_payload(megabytes, kind)
    results = []
    started.wait(600)
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            next_at = t0 + interval
            try:
                r = c.post(url + "/v1/completions", content=payload,
                           headers={"content-type": "application/json"})
                results.append((r.status_code, time.perf_counter() - t0))
            except httpx.HTTPError as e:
                results.append((type(e).__name__, time.perf_counter() - t0))
            stop.wait(max(0.0, next_at - time.perf_counter()))
    out.put(results)


def summary(gaps: list[float]) -> dict:
    s = sorted(gaps)
    return {"tokens": len(gaps) + 1, "median_tbt_ms": round(statistics.median(s) * 1e3, 2),
            "p99_tbt_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3, 2),
            "max_gap_ms": round(s[-1] * 1e3, 2)}


def run_config(args, limit: str) -> dict:
    proc, url = start_server(args, limit)
    try:
        stream_gaps(url, 8)  # warm-up
        rss_before = rss_mb(proc.pid)
        base = summary(stream_gaps(url, args.tokens))
        ctx = mp.get_context("spawn")
        started, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        sender = ctx.Process(target=send_big, args=(url, args.prompt_mb, args.body,
                                                    args.interval, started, stop, out))
        sender.start()
        gaps = stream_gaps(url, args.tokens, started)
        stop.set()
        big = out.get(timeout=600)
        sender.join(60)
        loaded = summary(gaps)
        statuses = sorted({str(s) for s, _ in big})
        return {
            "max_request_bytes": limit,
            "alone": base,
            "with_big_prompts": loaded,
            "big_prompts": {"sent": len(big), "statuses": statuses,
                            "median_latency_s": round(statistics.median(t for _, t in big), 3)
                            if big else None},
            "max_gap_over_baseline_median_tbt": round(
                loaded["max_gap_ms"] / base["median_tbt_ms"], 2),
            "max_gap_over_baseline_max_gap": round(loaded["max_gap_ms"] / base["max_gap_ms"], 2),
            "server_rss_mb": {"before": rss_before, "after": rss_mb(proc.pid)},
        }
    finally:
        stop_process(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model directory (default: the embedded one).")
    ap.add_argument("--prompt-mb", type=float, default=8.0, help="Size of each big prompt (MB).")
    ap.add_argument("--body", choices=("prompt", "objects"), default="prompt",
                    help="What the big bodies hold: one long prompt, or a one-token prompt and"
                         " an ignored field of small JSON objects.")
    ap.add_argument("--tokens", type=int, default=300, help="Tokens of the measured stream.")
    ap.add_argument("--interval", type=float, default=0.5,
                    help="Seconds between big prompts (0: back to back).")
    ap.add_argument("--limits", default="4194304,16777216",
                    help="Comma-separated --max-request-bytes values to compare ('none': omit"
                    " the flag).")
    ap.add_argument("--num-threads", type=int, default=1, help="Torch threads of the server.")
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH for the server process.")
    args = ap.parse_args()
    results = []
    for limit in args.limits.split(","):
        r = run_config(args, limit)
        print(f"max_request_bytes={limit}: stream alone {r['alone']}, with big prompts"
              f" {r['with_big_prompts']}, big prompts {r['big_prompts']}, server RSS"
              f" {r['server_rss_mb']} MB", file=sys.stderr)
        results.append(r)
    print(json.dumps({"benchmark": "stall", "prompt_mb": args.prompt_mb, "model": args.model,
                      "interval_s": args.interval, "results": results}))


if __name__ == "__main__":
    main()
