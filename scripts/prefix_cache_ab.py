"""Multi-turn chat with and without prefix caching, served side by side: a benchmark.

Serves a model (default: the embedded one) with `fluidserve serve`, then with
`fluidserve serve --enable-prefix-caching`, ``--rounds`` times alternated, and replays the same
conversations on each: ``--conversations`` of ``--turns`` turns each, all opening with one
shared system prompt of ``--system-tokens`` token ids; each turn's prompt is the last one plus
the last answer's length in ids and ``--user-tokens`` new ids, as a chat client resends its
history. Turns go out one at a time, conversations interleaved (turn 1 of each, then turn
2, ...), streamed; ``--max-tokens`` tokens each. Prints one JSON line per server and round
(mean and median time to first token, wall time, the prefix-cache hit rate from /metrics) and
a summary; ``--out`` writes them as JSON.

    python scripts/prefix_cache_ab.py --out runs/prefix-cache.json
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
from prometheus_client.parser import text_string_to_metric_families
from race_vllm_cpu import cpu_name  # (this directory's)

from fluidserve.net import free_port, stop_process, wait_healthy


def serve(model: str | None, caching: bool, threads: int):
    port = free_port()
    cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port),
           "--num-threads", str(threads)] + (["--model", model] if model else []) + (
        ["--enable-prefix-caching"] if caching else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, proc)
    return proc, url


def conversations(args, window: int) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn (token ids well inside any vocabulary)."""
    system = [100 + i % 500 for i in range(args.system_tokens)]
    out = []
    for c in range(args.conversations):
        prompt, turns = list(system), []
        for t in range(args.turns):
            prompt += [700 + (c * 31 + t * 7 + k) % 300 for k in range(args.user_tokens)]
            if len(prompt) + args.max_tokens > window:
                raise SystemExit(f"conversation {c} turn {t}: {len(prompt)} prompt tokens do"
                                 f" not fit the {window}-token window; use fewer turns or"
                                 " tokens")
            turns.append(list(prompt))
            prompt += [1000 + (c + t + k) % 300 for k in range(args.max_tokens)]  # its answer
        out.append(turns)
    return out


def measure(url: str, convs: list[list[list[int]]], max_tokens: int) -> dict:
    ttft = []
    with httpx.Client(timeout=600) as c:
        c.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        for turn in range(len(convs[0])):
            for conv in convs:
                body = {"prompt": conv[turn], "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True, "temperature": 0}
                start = time.perf_counter()
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    first = None
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                ttft.append(first - start)
        wall = time.perf_counter() - t0
        metrics = c.get(url + "/metrics").text
    counts = {s.name: s.value for f in text_string_to_metric_families(metrics)
              for s in f.samples}
    queries = counts["fluidserve_prefix_cache_queries_total"]
    hits = counts["fluidserve_prefix_cache_hits_total"]
    return {"mean_ttft_ms": round(statistics.mean(ttft) * 1e3, 1),
            "median_ttft_ms": round(statistics.median(ttft) * 1e3, 1),
            "wall_s": round(wall, 2),
            "hit_rate": round(hits / queries, 3) if queries else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Model directory (default: the embedded model).")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="Write the rows and summary here (JSON).")
    args = ap.parse_args()
    rows = []
    for rnd in range(args.rounds):
        for caching in (False, True) if rnd % 2 == 0 else (True, False):
            proc, url = serve(args.model, caching, args.num_threads)
            try:
                window = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
                row = {"prefix_caching": caching, "round": rnd} | measure(
                    url, conversations(args, window), args.max_tokens)
            finally:
                stop_process(proc)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for caching in (False, True):
        mine = [r for r in rows if r["prefix_caching"] is caching]
        summary["on" if caching else "off"] = {
            k: round(statistics.mean(r[k] for r in mine), 3)
            for k in ("mean_ttft_ms", "median_ttft_ms", "wall_s", "hit_rate")}
    summary["ttft_ratio_on_off"] = round(
        summary["on"]["mean_ttft_ms"] / summary["off"]["mean_ttft_ms"], 3)
    summary["cpu"] = cpu_name()
    summary["args"] = vars(args) | {"out": str(args.out) if args.out else None,
                                    "model": args.model}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
