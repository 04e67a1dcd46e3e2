"""Soak `fluidserve serve`: a long, seeded, open-loop mix of requests, then a verdict.

A benchmark program, not a test. It starts the server (``--serve-args`` are passed on), warms
it up, then for ``--duration`` seconds sends requests at ``--rate`` per second (Poisson
arrivals) drawn from a mix of kinds:

- ``stream``: a streamed completion that must end with its full ``max_tokens`` and [DONE];
- ``complete``: the same, not streamed;
- ``chat``: a streamed chat completion that must end with finish_reason and [DONE];
- ``abort``: a stream the client leaves after a few tokens (the server must free it);
- ``invalid``: a malformed or out-of-schema body that must get a JSON 4xx.

Every request is classified: ``ok`` (full output, or for ``abort`` the tokens it waited for,
for ``invalid`` its 4xx), ``error`` (an explicit error the client saw: an error event, an error
JSON body; 503 overload counts here), or ``lost`` (anything else: a cut stream, a missing
[DONE], a short output, a timeout). It reports counts by kind and outcome, the resident memory
of the front end and the engine core after warm-up and at the end, and P99 time between tokens
of the streamed requests per ``--window`` seconds. The last line is JSON, with the checks:
nothing lost, memory flat within 5 %, no P99 TBT drift (last window within ``--drift`` times
the first).

Run at 80 % of measured capacity (e.g. from ``fluidserve capacity``), 30 minutes:

    python scripts/soak.py --rate 2.4 --duration 1800
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from fluidserve.net import free_port, stop_process, wait_healthy

KINDS = {"stream": 0.45, "complete": 0.2, "chat": 0.15, "abort": 0.1, "invalid": 0.1}
WORDS = "the river rose slowly in spring and people of valley watched water climb".split()
INVALID = [
    b'{"prompt": ',
    b'{"prompt": "hi\\ud800"}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
    b'{"prompt": "x", "temperature": "hot"}',
]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def core_pid(server_pid: int) -> int | None:
    try:
        kids = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    except OSError:
        return None
    for kid in kids:
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return int(kid)
    return None


def memory(pid: int) -> dict:
    core = core_pid(pid)
    return {"front_end_mb": rss_mb(pid), "engine_core_mb": rss_mb(core) if core else None}


class Soak:
    def __init__(self, url: str, args) -> None:
        self.url, self.args = url, args
        self.rng = random.Random(args.seed)
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.gaps: list[tuple[float, float]] = []  # (time since start, gap) of streamed tokens
        self.examples: dict[str, str] = {}
        self.memory: list[dict] = []  # samples of the servers' memory, one per window
        self.server_pid: int | None = None
        self.t0 = 0.0

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(5, 120)))

    async def one(self, c: httpx.AsyncClient, kind: str, seed: int) -> None:
        try:
            outcome, why = await asyncio.wait_for(self._run(c, kind, seed), self.args.timeout)
        except Exception as e:  # noqa: BLE001 - whatever it was, the request was lost
            outcome, why = "lost", f"{type(e).__name__}: {e}"
        self.outcomes[kind][outcome] += 1
        if outcome != "ok":
            self.examples.setdefault(f"{kind}/{outcome}", why[:300])

    async def _run(self, c: httpx.AsyncClient, kind: str, seed: int) -> tuple[str, str]:
        n = self.rng.randint(8, self.args.max_tokens)
        if kind == "invalid":
            r = await c.post("/v1/completions", content=self.rng.choice(INVALID),
                             headers={"content-type": "application/json"})
            ok = 400 <= r.status_code < 500 and "error" in r.json()
            return ("ok" if ok else "lost"), f"{r.status_code} {r.text[:200]}"
        if kind == "complete":
            body = {"prompt": self.prompt(), "max_tokens": n, "ignore_eos": True, "seed": seed}
            r = await c.post("/v1/completions", json=body)
            if r.status_code != 200:
                return _explicit(r)
            got = r.json()["usage"]["completion_tokens"]
            return ("ok" if got == n else "lost"), f"{got} of {n} tokens"
        chat = kind == "chat"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"max_tokens": n, "ignore_eos": True, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt()}]
        else:
            body["prompt"] = self.prompt()
        leave_after = self.rng.randint(1, 5) if kind == "abort" else None
        return await self._stream(c, path, body, n, leave_after)

    async def _stream(self, c, path, body, n, leave_after) -> tuple[str, str]:
        async with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _explicit(r)
            tokens, last, usage, done, error = 0, None, None, False, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]["message"]
                    continue
                if obj.get("usage") and not obj["choices"]:
                    usage = obj["usage"]["completion_tokens"]
                    continue
                if obj["choices"] and "role" in obj["choices"][0].get("delta", {}):
                    continue  # the chat role chunk carries no token
                now = time.perf_counter()
                if last is not None:
                    self.gaps.append((now - self.t0, now - last))
                last, tokens = now, tokens + 1
                if leave_after is not None and tokens >= leave_after:
                    return "ok", "left"
        if error is not None and done:
            return "error", error
        if done and usage == n:
            return "ok", ""
        return "lost", f"done={done} usage={usage} tokens={tokens} of {n}"

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.args.timeout,
                                     limits=limits) as c:
            tasks = []
            kinds, weights = zip(*KINDS.items(), strict=True)
            self.t0 = time.perf_counter()
            end = self.t0 + self.args.duration
            t, i = self.t0, 0
            sampler = asyncio.create_task(self.sample_memory())
            while t < end:
                t += self.rng.expovariate(self.args.rate)
                await asyncio.sleep(max(0.0, t - time.perf_counter()))
                kind = self.rng.choices(kinds, weights)[0]
                tasks.append(asyncio.create_task(self.one(c, kind, i)))
                i += 1
            await asyncio.gather(*tasks)
            sampler.cancel()

    async def sample_memory(self) -> None:
        while self.server_pid is not None:
            at = round(time.perf_counter() - self.t0, 1)
            self.memory.append({"at_s": at} | memory(self.server_pid))
            await asyncio.sleep(min(self.args.window, 60.0))

    def tbt_windows(self) -> list[dict]:
        by: dict[int, list[float]] = defaultdict(list)
        for at, gap in self.gaps:
            by[int(at // self.args.window)].append(gap)
        out = []
        for w in sorted(by):
            g = sorted(by[w])
            out.append({"window_start_s": w * self.args.window, "tokens": len(g),
                        "p50_tbt_ms": round(g[len(g) // 2] * 1e3, 2),
                        "p99_tbt_ms": round(g[min(len(g) - 1, int(0.99 * len(g)))] * 1e3, 2)})
        return out


def _explicit(r: httpx.Response) -> tuple[str, str]:
    try:
        err = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "lost", f"{r.status_code} without an error body: {r.text[:200]}"
    return "error", f"{r.status_code} {err}"


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--port", str(port),
           *shlex.split(args.serve_args)]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600, proc)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2.0, help="Requests per second (Poisson).")
    ap.add_argument("--duration", type=float, default=1800.0, help="Seconds of load.")
    ap.add_argument("--warmup", type=float, default=30.0,
                    help="Seconds of load at --rate before memory is first measured.")
    ap.add_argument("--window", type=float, default=300.0, help="TBT window (s).")
    ap.add_argument("--max-tokens", type=int, default=64, help="Largest max_tokens drawn.")
    ap.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout (s).")
    ap.add_argument("--drift", type=float, default=1.5,
                    help="Largest allowed ratio of the last window's P99 TBT to the first's.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="--num-threads 1",
                    help="Flags for `fluidserve serve` (quoted).")
    ap.add_argument("--server-log", default=None, help="Write the server's log here.")
    args = ap.parse_args()

    proc, url = start_server(args)
    try:
        warm = Soak(url, argparse.Namespace(**vars(args) | {"duration": args.warmup}))
        asyncio.run(warm.run())
        mem_start = memory(proc.pid)
        soak = Soak(url, args)
        soak.server_pid = proc.pid
        t0 = time.perf_counter()
        asyncio.run(soak.run())
        elapsed = time.perf_counter() - t0
        time.sleep(2)  # let aborted requests be freed before the last reading
        mem_end = memory(proc.pid)
        health = httpx.get(url + "/health", timeout=5).status_code
    finally:
        code = stop_process(proc, 60)
    report(args, soak, mem_start, mem_end, elapsed, health, code)


def report(args, soak: Soak, mem_start, mem_end, elapsed, health, exit_code) -> None:
    counts = {k: dict(v) for k, v in sorted(soak.outcomes.items())}
    sent = sum(sum(v.values()) for v in soak.outcomes.values())
    lost = sum(v["lost"] for v in soak.outcomes.values())
    growth = {k: round((mem_end[k] - mem_start[k]) / mem_start[k] * 100, 2)
              for k in mem_start if mem_start[k] and mem_end.get(k)}
    windows = soak.tbt_windows()
    # Compare whole windows: the streams still finishing after the last one started leave a
    # window of a few dozen tokens, too few for a 99th percentile.
    whole = [w for w in windows if w["window_start_s"] + args.window <= args.duration] or windows
    drift = (whole[-1]["p99_tbt_ms"] / whole[0]["p99_tbt_ms"]) if len(whole) > 1 else 1.0
    checks = {"nothing_lost": lost == 0,
              "memory_flat_5pct": all(abs(g) <= 5 for g in growth.values()),
              "no_tbt_drift": drift <= args.drift,
              "healthy_at_end": health == 200,
              "clean_exit": exit_code == 0}
    out = {"benchmark": "soak", "rate": args.rate, "duration_s": args.duration,
           "elapsed_s": round(elapsed, 1), "sent": sent,
           "completed": sum(v["ok"] for v in soak.outcomes.values()),
           "errored": sum(v["error"] for v in soak.outcomes.values()), "lost": lost,
           "by_kind": counts, "examples": soak.examples,
           "memory_after_warmup": mem_start, "memory_end": mem_end,
           "memory_growth_pct": growth, "memory_samples": soak.memory, "tbt_windows": windows,
           "tbt_p99_last_over_first": round(drift, 2), "checks": checks,
           "passed": all(checks.values())}
    print(f"sent {sent}: {counts}; memory {mem_start} -> {mem_end}; P99 TBT per window"
          f" {[w['p99_tbt_ms'] for w in windows]} ms; checks {checks}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
