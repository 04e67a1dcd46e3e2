"""TetriInfer served for real on this machine: one prefill and one decode instance (one core
each) against one colocated instance on both cores, same model, same workloads, same client.

    python scripts/bench_disagg_served.py --out runs/disagg-served --doc docs/disaggregation.md

Each variant is a `fluidserve serve` process (its instances in processes of their own), driven
by `fluidserve bench` with TetriInfer's workload classes (LPLD, LPHD, HPLD, HPHD: light or heavy
prefill at 512 prompt tokens, light or heavy decode at 128 output tokens, from the sharegpt
trace's lengths) and their mix, Poisson arrivals, seeded. Variants: colocated Sarathi-Serve
(stall-free, budget 512, 2 threads), colocated vLLM-style scheduling (prefill-first, budget
2048, 2 threads: TetriInfer's baseline) and disaggregated 1P+1D (1 thread each, ChunkSize 512,
KV over gloo). The disaggregated run also writes a request log, and the learned length
predictor is trained on it (`fluidserve train-predictor`). Results: OUT/result.json, and the
report between the markers of --doc.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from race_report import write_doc  # noqa: E402
from race_vllm_cpu import KV_GIB, MAX_MODEL_LEN, MODEL_NAME, Server, machine  # noqa: E402

from fluidserve.net import free_port  # noqa: E402

BEGIN, END = "<!-- served-begin -->", "<!-- served-end -->"
CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD", "mixed")
VARIANTS = {  # file tag: (label, serve flags)
    "sarathi": ("sarathi x1 (2 threads)",
                ["--num-threads", "2", "--scheduler", "sarathi", "--token-budget", "512"]),
    "vllm": ("vllm x1 (2 threads)",
             ["--num-threads", "2", "--scheduler", "vllm", "--token-budget", "2048"]),
    "tetriinfer-1P+1D": ("tetriinfer 1P+1D (1 thread each)",
                         ["--disaggregate", "--num-threads", "1", "--prefill-chunk-size",
                          "512", "--kv-transport", "gloo"]),
    "tetriinfer-1P+1D-chunk": ("tetriinfer 1P+1D, KV chunk by chunk",
                               ["--disaggregate", "--num-threads", "1", "--prefill-chunk-size",
                                "512", "--kv-transport", "gloo", "--kv-transfer-granularity",
                                "chunk"]),
}
DEFAULT_VARIANTS = "sarathi,vllm,tetriinfer-1P+1D"


def log(msg: str) -> None:
    print(f"[disagg-served {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench(url: str, model: Path, dataset: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fluidserve.cli", "bench", "--base-url", url, "--model",
           MODEL_NAME, "--tokenizer", str(model), "--dataset-name", dataset, "--num-prompts",
           str(args.num_prompts), "--request-rate", str(args.rate), "--max-prompt-len",
           str(args.max_prompt_len), "--max-output-len", str(args.max_output_len), "--seed",
           "0", "--tbt-deadline", "0.2", "--output-dir", str(out), "--no-plots"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # The gap between the first and the second token: where a disaggregated deployment
    # hands the request (and its KV) from the prefill to the decode instance.
    second = [r["gaps"][1] for r in map(json.loads, open(out / "requests.jsonl"))
              if len(r["gaps"]) > 1 and not r["error"]]
    summary["handoff_gap_mean_s"] = sum(second) / len(second) if second else None
    return summary


def summarize(s: dict) -> dict:
    return {"completed": s["num_completed"], "failed": s["num_failed"],
            "handoff_gap_mean_s": s["handoff_gap_mean_s"],
            "duration_s": s["duration_s"], "output_tok_s": s["output_token_throughput"],
            "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p99_s": s["ttft_s"]["p99"],
            "jct_mean_s": s["e2e_latency_s"]["mean"], "tbt_p99_s": s["tbt_s"]["p99"],
            "fluidity_index": s["fluidity_index"]}


def run(args) -> dict:
    from fluidserve.model.builder import race_model_dir

    model = race_model_dir(log=log)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"started": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
           "num_prompts": args.num_prompts, "rate": args.rate,
           "max_prompt_len": args.max_prompt_len, "max_output_len": args.max_output_len,
           "variants": {}}
    for tag in args.variants.split(","):
        label, extra = VARIANTS[tag]
        flags = list(extra)
        request_log = out / f"{tag}-requests.jsonl"
        if "--disaggregate" in flags:
            request_log.unlink(missing_ok=True)
            flags += ["--request-log", str(request_log)]
        port = free_port()
        cmd = [sys.executable, "-m", "fluidserve.cli", "serve", "--model", str(model),
               "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
               str(MAX_MODEL_LEN), "--kv-cache-memory-gb", str(KV_GIB),
               "--served-model-name", MODEL_NAME, *flags]
        server = Server(label, cmd, {"PYTHONUNBUFFERED": "1"}, out / f"{tag}.log")
        server.port = port
        rows = {}
        with server:
            for dataset in args.classes.split(","):
                log(f"{label}: {dataset}")
                s = bench(server.url, model, dataset, args, out / f"{tag}-{dataset}")
                rows[dataset] = summarize(s)
                log(f"  {rows[dataset]}")
        res["variants"][label] = rows
        if request_log.exists():
            res["predictor"] = train_predictor(request_log, out)
    return res


def train_predictor(request_log: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "fluidserve.cli", "train-predictor",
                           "--request-log", str(request_log), "--out",
                           str(out / "length-predictor.json")],
                          check=True, capture_output=True, text=True)
    report = json.loads((out / "length-predictor.json").read_text())["report"]
    return report | {"text": done.stdout.strip()}


def report(res: dict, command: str) -> str:
    m = res["machine"]
    names = list(res["variants"])
    lines = [f"Measured {res['started']} on {m['cpu']} ({m['cores']} cores, read bandwidth"
             f" {m['read_bandwidth_gb_s']:.1f} GB/s) with the 213M bf16 GQA model, {KV_GIB} GiB"
             f" of KV cache per instance, {res['num_prompts']} requests per class, Poisson"
             f" {res['rate']} req/s, prompts up to {res['max_prompt_len']} and outputs up to"
             f" {res['max_output_len']} tokens. Command:", "", f"    {command}", ""]
    for metric, title, unit in (("ttft_mean_s", "mean TTFT", "s"),
                                ("jct_mean_s", "mean JCT (end-to-end latency)", "s"),
                                ("tbt_p99_s", "P99 TBT", "s"),
                                ("handoff_gap_mean_s", "mean gap between the first and the"
                                 " second token", "s"),
                                ("output_tok_s", "output throughput", "tok/s")):
        lines += [f"**{title}** ({unit}; ratio to {names[1]})", "",
                  "| class | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for cls in res["variants"][names[0]]:
            base = res["variants"][names[1]][cls][metric]
            cells = []
            for n in names:
                v = res["variants"][n][cls][metric]
                cells.append("-" if v is None else f"{v:.3f} ({v / base:.2f}x)" if base
                             else f"{v:.3f}")
            lines.append(f"| {cls} | " + " | ".join(cells) + " |")
        lines.append("")
    failed = sum(r["failed"] for v in res["variants"].values() for r in v.values())
    lines.append(f"Failed requests across all runs: {failed}.")
    if "predictor" in res:
        lines += ["", f"Learned length predictor on the disaggregated runs' request log:"
                  f" {res['predictor']['text']}"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/disagg-served")
    ap.add_argument("--doc", help="Write the report between the markers of this file.")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="Comma-separated, the second is the ratios' base; of"
                    f" {', '.join(VARIANTS)}.")
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help="Comma-separated workload classes.")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--max-prompt-len", type=int, default=1536)
    ap.add_argument("--max-output-len", type=int, default=256)
    args = ap.parse_args()
    res = run(args)
    out = Path(args.out)
    (out / "result.json").write_text(json.dumps(res, indent=1))
    text = report(res, "python " + " ".join(sys.argv))
    if args.doc:
        write_doc(Path(args.doc), text, out, BEGIN, END)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
